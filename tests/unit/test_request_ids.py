"""Which client request ids the gateway keeps: 1 to 128 visible ASCII characters, nothing else."""

from hypothesis import given, strategies as st

from llmgw.gateway.request_ids import MAX_CLIENT_ID_LENGTH, RequestIds, accepted_client_id

VISIBLE = bytes(range(0x21, 0x7F))


@given(st.lists(st.sampled_from(VISIBLE), min_size=1, max_size=MAX_CLIENT_ID_LENGTH).map(bytes))
def test_visible_ascii_up_to_the_limit_is_kept(value):
    assert accepted_client_id(value) == value.decode("ascii")


@given(st.binary(max_size=300))
def test_anything_else_is_replaced(value):
    kept = accepted_client_id(value)
    if kept is not None:
        assert 1 <= len(value) <= MAX_CLIENT_ID_LENGTH and all(c in VISIBLE for c in value)
        assert kept.encode("ascii") == value


def test_the_forgeries_of_the_hostile_probe_are_replaced():
    for value in (b"FAKE model=secret", b"a\tb", b"id\x85", b"\xe9t\xe9", b"x" * 60_000, b"",
                  b"x" * (MAX_CLIENT_ID_LENGTH + 1)):
        assert accepted_client_id(value) is None, value
    assert accepted_client_id(b"x" * MAX_CLIENT_ID_LENGTH) == "x" * MAX_CLIENT_ID_LENGTH


def test_own_ids_are_32_hex_digits_and_distinct():
    ids = RequestIds()
    made = {ids.next() for _ in range(1000)}
    assert len(made) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in made)
