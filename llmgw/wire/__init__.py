"""The agent <-> control-plane protocol, used by both ends.

``llmgw.wire`` itself is the message set (:mod:`llmgw.wire.messages`, re-exported here so that
``wire.StartShard`` reads as what it is); :mod:`llmgw.wire.channel` carries those messages over a
websocket or, for the embedded agent, an in-process channel.
"""

from .messages import *  # noqa: F401,F403  (the message set is this package's public face)
from .messages import __all__  # noqa: F401
