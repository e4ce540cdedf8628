"""Overload control at the gateway: priority classes, fair queueing by tokens, deadlines, and room learnt from the
engines (docs/overload.md).

- :mod:`.model`: the value types (classes, settings, a request's flow, the outcomes);
- :mod:`.interfaces`: what the queue asks of the room (:class:`~.interfaces.Room`) and what the data plane asks
  of the queue (:class:`~.interfaces.FlowControl`).
"""
