"""The data plane's cheap usage lookups, for tiers that want each response's usage (``wants_usage``)."""

from llmgw.gateway.usage import usage_of_body, usage_of_stream_tail

USAGE = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}


def test_usage_of_a_body():
    body = b'{"id":"x","choices":[{"text":"a \\"usage\\": 1"}],"usage": {"prompt_tokens": 40, "completion_tokens"' \
           b': 1, "prompt_tokens_details": {"cached_tokens": 32}}}'
    assert usage_of_body(body) == USAGE
    assert usage_of_body(b'{"id":"x"}') is None
    assert usage_of_body(b'{"usage": null}') is None
    assert usage_of_body(b'{"usage": {"prompt_tok') is None


def test_usage_of_a_streams_final_chunk_split_across_pieces():
    pieces = [b'data: {"choices":[{"delta":{}}],"usage":null}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1,',
              b'"prompt_tokens_details":{"cached_tokens":32}}}\r\n\r\n', b'data: [DONE]\n\n']
    assert usage_of_stream_tail(pieces) == USAGE
    assert usage_of_stream_tail([b'data: {"choices":[{"delta":{}}],"usage":null}\n\ndata: [DONE]\n\n']) is None
    assert usage_of_stream_tail([b'sage":{"prompt_tokens":4}}\n\ndata: [DONE]\n\n']) is None
    assert usage_of_stream_tail([]) is None
