"""An approximate radix tree of which replica was sent which text, bounded by size and age.

One tree per model. Each edge holds a run of characters (edge-compressed;
children keyed by their first character) and each node the replicas that
were sent a text through it, with the time each last was. Ownership is
prefix-closed (a replica that owns a node owns all its ancestors) and times
never increase going down (inserting refreshes the whole path), which is
what makes both lookups and eviction cheap:

- :meth:`RadixTree.match` walks the text once and returns, per replica, how
  many leading characters it holds (entries older than the TTL do not count);
- :meth:`RadixTree.insert` records a text for a replica, then evicts every
  replica's leaves older than ``ttl``, and the least recently used leaves of
  any replica holding more than ``max_chars_per_replica`` characters or
  ``max_nodes_per_replica`` nodes.

Eviction pops a per-replica heap of candidate leaves ``(time, seq, node)``
that is pushed on insert and when a node becomes a leaf; stale entries are
skipped when popped and dropped in bulk when the heap outgrows the nodes it
could describe. No step walks the whole tree, so a decision never pays for a
sweep. A node no replica owns is removed, so memory is bounded by
``replicas x max_chars_per_replica`` characters and
``replicas x max_nodes_per_replica`` nodes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass


class Node:
    __slots__ = ("key", "children", "parent", "owners")

    def __init__(self, key: str, parent: "Node | None"):
        self.key = key
        self.children: dict[str, Node] = {}
        self.parent = parent
        self.owners: dict[str, float] = {}  # replica name -> last time a text through here was sent to it


@dataclass
class TreeStats:
    nodes: int
    chars: int
    replica_chars: dict[str, int]
    replica_nodes: dict[str, int]
    evicted_for_size: int
    evicted_for_age: int


def _common_prefix_length(key: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``key`` and ``text[pos:]``, by bisection over C-level compares."""
    low, high = 0, min(len(key), len(text) - pos)
    while low < high:
        middle = (low + high + 1) // 2
        if text.startswith(key[:middle], pos):
            low = middle
        else:
            high = middle - 1
    return low


class RadixTree:
    def __init__(self, max_chars_per_replica: int = 2_000_000, max_nodes_per_replica: int = 100_000,
                 ttl: float = 600.0):
        if max_chars_per_replica < 1 or max_nodes_per_replica < 1 or not ttl > 0:
            raise ValueError("tree limits and TTL must be positive")
        self.max_chars_per_replica = max_chars_per_replica
        self.max_nodes_per_replica = max_nodes_per_replica
        self.ttl = ttl
        self.root = Node("", None)
        self.node_count = 0  # excluding the root
        self.char_count = 0  # characters stored on edges
        self.replica_chars: dict[str, int] = {}
        self.replica_nodes: dict[str, int] = {}
        self.evicted_for_size = 0  # (node, replica) ownerships dropped
        self.evicted_for_age = 0
        self._leaves: dict[str, list[tuple[float, int, Node]]] = {}
        self._seq = itertools.count()

    # -- lookups -----------------------------------------------------------------------------------------------------

    def match(self, text: str, now: float) -> dict[str, int]:
        """Per replica, the number of leading characters of ``text`` it holds (replicas holding none are absent)."""
        cutoff = now - self.ttl
        matched: dict[str, int] = {}
        node = self.root
        pos, end = 0, len(text)
        while pos < end:
            child = node.children.get(text[pos])
            if child is None:
                break
            key = child.key
            if text.startswith(key, pos):
                pos += len(key)
                partial = False
            else:
                pos += _common_prefix_length(key, text, pos)
                partial = True
            live = False
            for name, last in child.owners.items():
                if last >= cutoff:
                    matched[name] = pos
                    live = True
            if partial or not live:
                break
            node = child
        return matched

    # -- updates -----------------------------------------------------------------------------------------------------

    def insert(self, text: str, replica: str, now: float) -> None:
        """Record that ``text`` was sent to ``replica`` at ``now``, then evict what the limits require."""
        if text:
            leaf = self._insert_path(text, replica, now)
            self._push_leaf(replica, leaf, now)
        self.evict(now)

    def _insert_path(self, text: str, replica: str, now: float) -> Node:
        node = self.root
        pos, end = 0, len(text)
        added_chars = added_nodes = 0
        while pos < end:
            first = text[pos]
            child = node.children.get(first)
            if child is None:
                child = Node(text[pos:], node)
                node.children[first] = child
                self.node_count += 1
                self.char_count += end - pos
                pos = end
            else:
                key = child.key
                if text.startswith(key, pos):
                    pos += len(key)
                else:
                    common = _common_prefix_length(key, text, pos)
                    child = self._split(child, common)
                    pos += common
            if replica not in child.owners:
                added_chars += len(child.key)
                added_nodes += 1
            child.owners[replica] = now
            node = child
        self.replica_chars[replica] = self.replica_chars.get(replica, 0) + added_chars
        self.replica_nodes[replica] = self.replica_nodes.get(replica, 0) + added_nodes
        return node

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` characters; the new upper node is returned."""
        parent = child.parent
        assert parent is not None  # the root is never split
        upper = Node(child.key[:at], parent)
        upper.owners = dict(child.owners)
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        self.node_count += 1
        for name in upper.owners:
            self.replica_nodes[name] += 1
        return upper

    def _push_leaf(self, replica: str, node: Node, last: float) -> None:
        heap = self._leaves.setdefault(replica, [])
        heapq.heappush(heap, (last, next(self._seq), node))
        if len(heap) > 2 * self.replica_nodes.get(replica, 0) + 1024:
            # Drop entries that no longer describe the node (it was refreshed or evicted since).
            heap[:] = [entry for entry in heap if entry[2].owners.get(replica) == entry[0]]
            heapq.heapify(heap)

    def evict(self, now: float) -> None:
        """Drop every replica's entries older than the TTL, then its oldest ones while it is over a limit.

        (Inserting for one replica can put another over its node limit: splitting
        an edge they share adds a node to both.)
        """
        cutoff = now - self.ttl
        max_chars, max_nodes = self.max_chars_per_replica, self.max_nodes_per_replica
        for name, heap in list(self._leaves.items()):
            while heap and heap[0][0] < cutoff:
                self._evict_oldest(name, heap, for_age=True)
            while heap and (self.replica_chars[name] > max_chars or self.replica_nodes[name] > max_nodes):
                self._evict_oldest(name, heap, for_age=False)
            if not heap and not self.replica_nodes.get(name):
                self._forget_replica_counters(name)

    def remove_replica(self, replica: str) -> None:
        """Forget everything ``replica`` owns (e.g. it left the model)."""
        heap = self._leaves.get(replica)
        while heap:
            self._evict_oldest(replica, heap, for_age=True)
        self._forget_replica_counters(replica)

    def _forget_replica_counters(self, name: str) -> None:
        self._leaves.pop(name, None)
        self.replica_chars.pop(name, None)
        self.replica_nodes.pop(name, None)

    def _evict_oldest(self, replica: str, heap: list[tuple[float, int, Node]], *, for_age: bool) -> None:
        last, _, node = heapq.heappop(heap)
        if node.owners.get(replica) != last:
            return  # stale: refreshed since, or already evicted
        for child in node.children.values():
            if replica in child.owners:
                return  # not a leaf for this replica: its descendants' entries come first
        del node.owners[replica]
        self.replica_chars[replica] -= len(node.key)
        self.replica_nodes[replica] -= 1
        if for_age:
            self.evicted_for_age += 1
        else:
            self.evicted_for_size += 1
        parent = node.parent
        assert parent is not None  # an entry still owned is attached, and the root is never in a heap
        if not node.owners and not node.children:
            del parent.children[node.key[0]]
            node.parent = None
            self.node_count -= 1
            self.char_count -= len(node.key)
        if parent is not self.root and replica in parent.owners and not any(
                replica in sibling.owners for sibling in parent.children.values()):
            heapq.heappush(heap, (parent.owners[replica], next(self._seq), parent))

    # -- introspection -----------------------------------------------------------------------------------------------

    def stats(self) -> TreeStats:
        return TreeStats(self.node_count, self.char_count, dict(self.replica_chars), dict(self.replica_nodes),
                         self.evicted_for_size, self.evicted_for_age)

    def check_invariants(self) -> None:
        """Walk the whole tree and assert every counter and the ownership rules (for tests; O(tree))."""
        nodes = chars = 0
        replica_chars: dict[str, int] = {}
        replica_nodes: dict[str, int] = {}
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.key and child.key[0] == first and child.parent is node
                assert child.owners or child.children, "a node nobody owns must be removed"
                for name, last in child.owners.items():
                    if node is not self.root:
                        assert node.owners.get(name, -math.inf) >= last, "ownership is prefix-closed, times fall"
                    replica_chars[name] = replica_chars.get(name, 0) + len(child.key)
                    replica_nodes[name] = replica_nodes.get(name, 0) + 1
                nodes += 1
                chars += len(child.key)
                stack.append(child)
        assert nodes == self.node_count and chars == self.char_count
        assert {k: v for k, v in self.replica_chars.items() if v} == replica_chars
        assert {k: v for k, v in self.replica_nodes.items() if v} == replica_nodes
