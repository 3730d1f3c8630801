"""conformance.case.data: what crosses a process boundary (every rank's
observation) comes back as it left, through JSON; to_data gives what
dataclasses.asdict gives."""

from __future__ import annotations

import collections
import dataclasses
import json
import math

from conformance.case.data import Record, from_data, to_data

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True)
class Leaf(Record):
    name: str
    sizes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Node(Record):
    leaf: Leaf
    leaves: tuple[Leaf, ...] = ()
    maybe_leaf: Leaf | None = None
    either: Leaf | tuple[str, ...] | None = None
    pairs: tuple[tuple[str, bool], ...] = ()
    table: dict[str, list] = dataclasses.field(default_factory=dict)
    loss: float = 0.0
    error: str | None = None
    nested: tuple = ()


_NODE = Node(
    leaf=Leaf("a", (1, 2)),
    leaves=(Leaf("b"), Leaf("c", (3,))),
    maybe_leaf=Leaf("d"),
    either=("x", "y"),
    pairs=(("p", True), ("q", False)),
    table={"k": [1, [2, 3]]},
    loss=1.5,
    nested=((1, (2, 3)), "s"),
)


def test_a_record_comes_back_through_json_as_it_left():
    for node in (_NODE, dataclasses.replace(_NODE, either=Leaf("e"), maybe_leaf=None, error="boom"), Node(Leaf(""))):
        back = Node.from_dict(json.loads(node.to_json()))
        assert back == node
        assert type(back.leaves) is tuple and all(type(x) is Leaf for x in back.leaves)


def test_to_data_is_what_asdict_gives():
    for obj in (_NODE, Pair(Leaf("a"), [Leaf("b")]), Node(Leaf("n"), table={"t": {"u": (1, 2)}})):
        target = obj if dataclasses.is_dataclass(obj) else Node(Leaf("w"), nested=obj)
        assert to_data(target) == dataclasses.asdict(target)
        assert json.dumps(to_data(target), sort_keys=True) == json.dumps(dataclasses.asdict(target), sort_keys=True)
    # a namedtuple keeps its type, as asdict keeps it
    assert type(to_data(Node(Leaf("w"), nested=Pair(1, 2))).get("nested")) is Pair


def test_to_data_copies_containers():
    node = Node(Leaf("a"), table={"k": [1, 2]})
    out = to_data(node)
    out["table"]["k"].append(3)
    assert node.table == {"k": [1, 2]}


def test_a_nan_loss_crosses_as_nan():
    back = Node.from_dict(json.loads(json.dumps(to_data(Node(Leaf("a"), loss=float("nan"))))))
    assert math.isnan(back.loss)


def test_an_already_built_dataclass_is_kept():
    leaf = Leaf("a")
    assert from_data(Leaf, leaf) is leaf
    assert from_data(Node, None) is None
