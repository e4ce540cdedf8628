"""What the gateway tells the busy signal a replica takes before it is full (GatewayAutoscale._seats_of): the
engine's seats (learnt, else declared) as the default class may fill them, or the room's learnt capacity."""

from __future__ import annotations

from types import SimpleNamespace

from llmgw.gateway.autoscale_setup import GatewayAutoscale


def seats_of(learnt_seats, capacity, declared, fill):
    room = SimpleNamespace(seats=lambda replica: learnt_seats, capacity=lambda replica: capacity)
    gateway = GatewayAutoscale.__new__(GatewayAutoscale)
    gateway.flow = SimpleNamespace(room=room)
    gateway.declared_seats = {} if declared is None else {"tiny": declared}
    gateway.default_fill = fill
    return gateway._seats_of(SimpleNamespace(model="tiny"))


def test_the_default_class_fills_floor_of_its_share_of_the_seats_at_least_one():
    assert seats_of(None, None, 2, 0.95) == 1  # the standard class on a 2-seat engine: one at a time
    assert seats_of(None, None, 2, 1.0) == 2
    assert seats_of(None, None, 256, 0.95) == 243
    assert seats_of(1, None, None, 0.5) == 1


def test_learnt_seats_win_over_declared_ones_and_a_lower_capacity_over_both():
    assert seats_of(8, None, 2, 1.0) == 8
    assert seats_of(8, 3, 2, 1.0) == 3  # the room admits no more than its learnt capacity
    assert seats_of(None, 40, None, 1.0) == 40  # no seats known: the capacity alone
    assert seats_of(None, None, None, 1.0) is None
