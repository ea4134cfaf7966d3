"""Domains and structural task families of the synthetic stateful tool-use environment.

Each domain (bank, shop, hotel, dispatch) is a small state class whose public methods are
the tools. Each family (``Task.family``, e.g. ``bank.transfer_report``) is a task template:
it samples parameters and an initial state from a seeded RNG, renders a short instruction,
knows the oracle tool calls and the checks over the final state that score an episode.
Everything is JSON-able, so a task payload rebuilds the task exactly.

``dispatch.ship`` (8 customers) and ``fleet.ship`` (64) are opt-in (:data:`OPT_IN_FAMILIES`)
and have a hidden rule: each customer ships through its own hub (:data:`HIDDEN_RULES`, a fixed seeded map the instruction never
states), while the warm-up tasks draw the hub at random, so a warmed-up model can learn to
read the hub from a privileged context but not the map. The CPU miniature is built on it
(docs/miniature.md).
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Callable

from lopd_jax.envs.base import ToolError
from lopd_jax.core.types import ToolCall

ACCOUNTS = ("alice", "bob", "carol", "dave", "erin", "frank", "gina", "hugo")
ITEMS = ("pens", "cups", "books", "lamps", "plates", "socks", "hats", "mugs")
GUESTS = ("mia", "noah", "liam", "emma", "omar", "zoe", "ivy", "leo")
ROOMS = ("101", "102", "201", "202", "301", "302")
# dispatch: customers and hubs (hub names are words of the tiny tokenizer's built-in corpus, so
# each is one token: reading one from a context is choosing one token, not copying a string)
CUSTOMERS = ACCOUNTS
HUBS = ("Paris", "Berlin", "Tokyo", "Oslo")
# fleet: the same rule over 64 customers (names of several tokens are fine: the policy copies
# the customer from the instruction), so held-out tasks spread over many independent
# clusters and an arm comparison's interval can narrow (docs/statistics.md)
FLEET_CUSTOMERS = ACCOUNTS + GUESTS + (
    "ava", "ben", "cleo", "dan", "eli", "fay", "gus", "hana", "ian", "jay", "kai", "lea", "max", "nia", "otto",
    "pia", "quinn", "ray", "sam", "tess", "uma", "vic", "wes", "xena", "yuri", "zack", "amy", "bea", "cal", "dora",
    "ed", "finn", "gwen", "hal", "iris", "jon", "kate", "lou", "mel", "ned", "ola", "pat", "rose", "sid", "tom",
    "val", "will", "yara")


# ---------------------------------------------------------------------------------------
# State classes (their public methods are the tools).


class Bank:
    """Bank accounts with whole-number balances."""

    def __init__(self, balances: dict[str, int]):
        """Start from ``balances`` (account name -> balance)."""
        self.balances = dict(balances)

    def _account(self, account: str) -> str:
        if account not in self.balances:
            raise ToolError(f"no account named {account!r}; accounts: {sorted(self.balances)}")
        return account

    @staticmethod
    def _positive(amount: int) -> int:
        if amount <= 0:
            raise ToolError(f"amount must be a positive whole number, got {amount}")
        return amount

    def get_balance(self, account: str) -> int:
        """Return the balance of an account.

        Args:
            account: the account owner's name.
        """
        return self.balances[self._account(account)]

    def deposit(self, account: str, amount: int) -> str:
        """Add money to an account.

        Args:
            account: the account owner's name.
            amount: how much to add.
        """
        self.balances[self._account(account)] += self._positive(amount)
        return f"{account} balance: {self.balances[account]}"

    def withdraw(self, account: str, amount: int) -> str:
        """Take money out of an account.

        Args:
            account: the account owner's name.
            amount: how much to take out.
        """
        self._account(account)
        if self.balances[account] < self._positive(amount):
            raise ToolError(f"{account} has only {self.balances[account]}")
        self.balances[account] -= amount
        return f"{account} balance: {self.balances[account]}"

    def transfer(self, source: str, target: str, amount: int) -> str:
        """Move money from one account to another.

        Args:
            source: the account to take money from.
            target: the account to give money to.
            amount: how much to move.
        """
        self._account(source)
        self._account(target)
        if source == target:
            raise ToolError("source and target must be different accounts")
        if self.balances[source] < self._positive(amount):
            raise ToolError(f"{source} has only {self.balances[source]}")
        self.balances[source] -= amount
        self.balances[target] += amount
        return "transfer done"


class Shop:
    """A shop's stock: item name -> units on hand."""

    def __init__(self, stock: dict[str, int]):
        """Start from ``stock`` (item name -> units)."""
        self.stock = dict(stock)

    def _item(self, item: str) -> str:
        if item not in self.stock:
            raise ToolError(f"no item named {item!r}; items: {sorted(self.stock)}")
        return item

    def check_stock(self, item: str) -> int:
        """Return how many units of an item are in stock.

        Args:
            item: the item name, e.g. pens.
        """
        return self.stock[self._item(item)]

    def restock(self, item: str, quantity: int) -> str:
        """Add units of an item to the stock.

        Args:
            item: the item name.
            quantity: how many units to add.
        """
        self._item(item)
        if quantity <= 0:
            raise ToolError(f"quantity must be a positive whole number, got {quantity}")
        self.stock[item] += quantity
        return f"{item} in stock: {self.stock[item]}"

    def sell(self, item: str, quantity: int) -> str:
        """Sell units of an item (removes them from the stock).

        Args:
            item: the item name.
            quantity: how many units to sell.
        """
        self._item(item)
        if quantity <= 0:
            raise ToolError(f"quantity must be a positive whole number, got {quantity}")
        if self.stock[item] < quantity:
            raise ToolError(f"only {self.stock[item]} {item} in stock")
        self.stock[item] -= quantity
        return f"{item} in stock: {self.stock[item]}"


class Hotel:
    """Hotel rooms: room number -> guest name, or "" when the room is free."""

    def __init__(self, rooms: dict[str, str]):
        """Start from ``rooms`` (room number -> guest or "")."""
        self.rooms = dict(rooms)

    def _room(self, room: str) -> str:
        if room not in self.rooms:
            raise ToolError(f"no room {room!r}; rooms: {sorted(self.rooms)}")
        return room

    def list_free_rooms(self, floor: int | None = None) -> list[str]:
        """List the free rooms, optionally only those on one floor.

        Args:
            floor: only list rooms on this floor (room 201 is on floor 2).
        """
        return [r for r, g in sorted(self.rooms.items())
                if not g and (floor is None or r.startswith(str(floor)))]

    def book_room(self, room: str, guest: str) -> str:
        """Book a free room for a guest.

        Args:
            room: the room number, e.g. "101".
            guest: the guest's name.
        """
        if self.rooms[self._room(room)]:
            raise ToolError(f"room {room} is taken by {self.rooms[room]}")
        self.rooms[room] = guest
        return f"room {room} booked for {guest}"

    def cancel_booking(self, room: str) -> str:
        """Cancel the booking of a room, making it free.

        Args:
            room: the room number.
        """
        if not self.rooms[self._room(room)]:
            raise ToolError(f"room {room} is already free")
        self.rooms[room] = ""
        return f"room {room} is now free"


class Dispatch:
    """Outgoing orders: customer -> the hub their order was shipped through ("" = not yet)."""

    def __init__(self, shipped: dict[str, str]):
        """Start from ``shipped`` (customer -> hub or "")."""
        self.shipped = dict(shipped)

    def ship_order(self, customer: str, hub: str) -> str:
        """Ship a customer's pending order through a hub.

        Args:
            customer: the customer's name.
            hub: the hub city the order goes through.
        """
        if customer not in self.shipped:
            raise ToolError(f"no customer named {customer!r}")
        if hub not in HUBS:
            raise ToolError(f"no hub named {hub!r}")
        if self.shipped[customer]:
            raise ToolError(f"{customer}'s order already shipped via {self.shipped[customer]}")
        self.shipped[customer] = hub
        return f'{customer}\'s order shipped via "{hub}"'


@dataclasses.dataclass(frozen=True)
class Domain:
    """A domain: its state class, the payload key of its state, and its system prompt."""

    name: str
    state_cls: type
    state_key: str
    system: str

    def build(self, initial: dict[str, Any]) -> Any:
        """A fresh state object from the task's initial state."""
        return self.state_cls(initial)

    def snapshot(self, state: Any) -> dict[str, Any]:
        """The state's data (what checks compare)."""
        return dict(getattr(state, self.state_key))


DOMAINS = {
    "bank": Domain("bank", Bank, "balances",
                   "You are a bank assistant. Use the tools, then answer briefly."),
    "shop": Domain("shop", Shop, "stock",
                   "You are a shop assistant. Use the tools, then answer briefly."),
    "hotel": Domain("hotel", Hotel, "rooms",
                    "You are a hotel assistant. Use the tools, then answer briefly."),
}
OPT_IN_DOMAINS = {
    "dispatch": Domain("dispatch", Dispatch, "shipped",
                       "You are a dispatch assistant. Use the tools, then answer briefly."),
    "fleet": Domain("fleet", Dispatch, "shipped",
                    "You are a dispatch assistant. Use the tools, then answer briefly."),
}
ALL_DOMAINS = {**DOMAINS, **OPT_IN_DOMAINS}


# ---------------------------------------------------------------------------------------
# Families.

Check = tuple[str, Callable[[dict[str, Any], str], bool]]


@dataclasses.dataclass(frozen=True)
class Family:
    """A structural task family: sampler, instruction, oracle and checks.

    ``sample(rng)`` returns the parameters (including ``"initial"``, the initial state
    data); ``oracle(params)`` returns the exact tool calls and a correct final answer;
    ``checks(params)`` returns (description, predicate(final_state, answer)) pairs.
    """

    family_id: str
    domain: str
    sample: Callable[[random.Random], dict[str, Any]]
    instruction: Callable[[dict[str, Any]], str]
    oracle: Callable[[dict[str, Any]], tuple[list[ToolCall], str]]
    checks: Callable[[dict[str, Any]], list[Check]]


def mentions(answer: str, value: Any) -> bool:
    """Whether ``answer`` contains ``value`` as a whole word/number."""
    return re.search(rf"(?<![\w]){re.escape(str(value))}(?![\w])", answer or "") is not None


def _unchanged(initial: dict[str, Any], keys: tuple[str, ...]) -> Check:
    others = {k: v for k, v in initial.items() if k not in keys}
    return ("nothing else changed",
            lambda st, ans: {k: v for k, v in st.items() if k not in keys} == others)


def _equals(key: str, value: Any) -> Check:
    return (f"{key} is {value!r}", lambda st, ans: st.get(key) == value)


def _answer(value: Any) -> Check:
    return (f"answer mentions {value}", lambda st, ans: mentions(ans, value))


def _accounts(rng: random.Random) -> dict[str, int]:
    return {a: rng.randrange(20, 201, 10) for a in rng.sample(ACCOUNTS, 3)}


def _sample_deposit(rng):
    init = _accounts(rng)
    return {"initial": init, "account": rng.choice(sorted(init)),
            "amount": rng.randrange(10, 101, 10)}


def _sample_transfer(rng):
    init = _accounts(rng)
    src, dst = rng.sample(sorted(init), 2)
    return {"initial": init, "source": src, "target": dst,
            "amount": rng.randrange(10, min(init[src], 100) + 1, 10)}


def _sample_withdraw(rng):
    init = _accounts(rng)
    return {"initial": init, "account": rng.choice(sorted(init)),
            "amount": rng.randrange(30, 151, 10)}


def _withdraw_ok(p):
    return p["initial"][p["account"]] >= p["amount"]


def _sample_restock_below(rng):
    items = rng.sample(ITEMS, 3)
    item, threshold = items[0], rng.choice((5, 8, 10, 12))
    stock = {i: rng.randrange(0, 21) for i in items}
    # Half the tasks need the restock and half not, so reading the stock matters.
    stock[item] = rng.randrange(0, threshold) if rng.random() < 0.5 else \
        rng.randrange(threshold, threshold + 10)
    return {"initial": stock, "item": item, "threshold": threshold,
            "quantity": rng.choice((5, 10, 15, 20))}


def _sample_sell(rng):
    items = rng.sample(ITEMS, 3)
    stock = {i: rng.randrange(5, 21) for i in items}
    return {"initial": stock, "item": items[0], "quantity": rng.randrange(1, 5)}


def _sample_restock_two(rng):
    items = rng.sample(ITEMS, 3)
    return {"initial": {i: rng.randrange(0, 21) for i in items},
            "item1": items[0], "quantity1": rng.choice((5, 10, 15, 20)),
            "item2": items[1], "quantity2": rng.choice((5, 10, 15, 20))}


def _rooms(rng: random.Random, occupied: float = 0.5) -> dict[str, str]:
    guests = iter(rng.sample(GUESTS, len(ROOMS)))
    return {r: (next(guests) if rng.random() < occupied else "") for r in ROOMS}


def _guest_elsewhere(rooms: dict[str, str], rng: random.Random) -> str:
    return rng.choice([g for g in GUESTS if g not in rooms.values()])


def _sample_book(rng):
    rooms = _rooms(rng)
    room = rng.choice(ROOMS)
    rooms[room] = ""
    return {"initial": rooms, "room": room, "guest": _guest_elsewhere(rooms, rng)}


def _sample_move(rng):
    rooms = _rooms(rng)
    r1, r2 = rng.sample(ROOMS, 2)
    rooms[r2] = ""
    if not rooms[r1]:
        rooms[r1] = _guest_elsewhere(rooms, rng)
    return {"initial": rooms, "guest": rooms[r1], "from_room": r1, "to_room": r2}


def _sample_free_on_floor(rng):
    rooms = _rooms(rng, occupied=0.6)
    floor = rng.choice((1, 2, 3))
    if all(rooms[r] for r in ROOMS if r.startswith(str(floor))):
        rooms[rng.choice([r for r in ROOMS if r.startswith(str(floor))])] = ""
    return {"initial": rooms, "floor": floor, "guest": _guest_elsewhere(rooms, rng)}


def _first_free(p):
    return next(r for r in ROOMS if r.startswith(str(p["floor"])) and not p["initial"][r])


def _free_on_floor_checks(p):
    def booked(st):
        return [r for r, g in st.items() if g == p["guest"]]

    def good_room(st, ans):
        rooms = booked(st)
        return len(rooms) == 1 and rooms[0].startswith(str(p["floor"])) \
            and not p["initial"][rooms[0]]

    def others(st, ans):
        mine = booked(st)
        return all(st[r] == g for r, g in p["initial"].items() if r not in mine)

    def answer(st, ans):
        rooms = booked(st)
        return len(rooms) == 1 and mentions(ans, rooms[0])

    return [(f"{p['guest']} has one free room on floor {p['floor']}", good_room),
            ("nothing else changed", others), ("answer names the booked room", answer)]


def _call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name, arguments)


FAMILIES: dict[str, Family] = {f.family_id: f for f in [
    Family(
        "bank.deposit", "bank", _sample_deposit,
        lambda p: f"Deposit {p['amount']} into {p['account']}'s account.",
        lambda p: ([_call("deposit", account=p["account"], amount=p["amount"])], "Done."),
        lambda p: [_equals(p["account"], p["initial"][p["account"]] + p["amount"]),
                   _unchanged(p["initial"], (p["account"],))]),
    Family(
        "bank.transfer_report", "bank", _sample_transfer,
        lambda p: (f"Transfer {p['amount']} from {p['source']} to {p['target']}, "
                   f"then tell me {p['target']}'s balance."),
        lambda p: ([_call("transfer", source=p["source"], target=p["target"],
                          amount=p["amount"]),
                    _call("get_balance", account=p["target"])],
                   f"{p['target']} has {p['initial'][p['target']] + p['amount']}."),
        lambda p: [_equals(p["source"], p["initial"][p["source"]] - p["amount"]),
                   _equals(p["target"], p["initial"][p["target"]] + p["amount"]),
                   _unchanged(p["initial"], (p["source"], p["target"])),
                   _answer(p["initial"][p["target"]] + p["amount"])]),
    Family(
        "bank.withdraw_if_enough", "bank", _sample_withdraw,
        lambda p: (f"If {p['account']} has at least {p['amount']}, "
                   f"withdraw {p['amount']} from {p['account']}."),
        lambda p: ([_call("get_balance", account=p["account"])]
                   + ([_call("withdraw", account=p["account"], amount=p["amount"])]
                      if _withdraw_ok(p) else []),
                   "Done." if _withdraw_ok(p) else "Not enough money, so I did nothing."),
        lambda p: [_equals(p["account"], p["initial"][p["account"]]
                           - (p["amount"] if _withdraw_ok(p) else 0)),
                   _unchanged(p["initial"], (p["account"],))]),
    Family(
        "shop.restock_below", "shop", _sample_restock_below,
        lambda p: (f"If we have fewer than {p['threshold']} {p['item']}, "
                   f"restock {p['quantity']} {p['item']}."),
        lambda p: ([_call("check_stock", item=p["item"])]
                   + ([_call("restock", item=p["item"], quantity=p["quantity"])]
                      if p["initial"][p["item"]] < p["threshold"] else []), "Done."),
        lambda p: [_equals(p["item"], p["initial"][p["item"]]
                           + (p["quantity"] if p["initial"][p["item"]] < p["threshold"]
                              else 0)),
                   _unchanged(p["initial"], (p["item"],))]),
    Family(
        "shop.sell_report", "shop", _sample_sell,
        lambda p: f"Sell {p['quantity']} {p['item']}, then tell me how many are left.",
        lambda p: ([_call("sell", item=p["item"], quantity=p["quantity"])],
                   f"{p['initial'][p['item']] - p['quantity']} {p['item']} left."),
        lambda p: [_equals(p["item"], p["initial"][p["item"]] - p["quantity"]),
                   _unchanged(p["initial"], (p["item"],)),
                   _answer(p["initial"][p["item"]] - p["quantity"])]),
    Family(
        "shop.restock_two", "shop", _sample_restock_two,
        lambda p: f"Restock {p['quantity1']} {p['item1']} and {p['quantity2']} {p['item2']}.",
        lambda p: ([_call("restock", item=p["item1"], quantity=p["quantity1"]),
                    _call("restock", item=p["item2"], quantity=p["quantity2"])], "Done."),
        lambda p: [_equals(p["item1"], p["initial"][p["item1"]] + p["quantity1"]),
                   _equals(p["item2"], p["initial"][p["item2"]] + p["quantity2"]),
                   _unchanged(p["initial"], (p["item1"], p["item2"]))]),
    Family(
        "hotel.book_room", "hotel", _sample_book,
        lambda p: f"Book room {p['room']} for {p['guest']}.",
        lambda p: ([_call("book_room", room=p["room"], guest=p["guest"])], "Done."),
        lambda p: [_equals(p["room"], p["guest"]), _unchanged(p["initial"], (p["room"],))]),
    Family(
        "hotel.move_guest", "hotel", _sample_move,
        lambda p: f"Move {p['guest']} from room {p['from_room']} to room {p['to_room']}.",
        lambda p: ([_call("cancel_booking", room=p["from_room"]),
                    _call("book_room", room=p["to_room"], guest=p["guest"])], "Done."),
        lambda p: [_equals(p["from_room"], ""), _equals(p["to_room"], p["guest"]),
                   _unchanged(p["initial"], (p["from_room"], p["to_room"]))]),
    Family(
        "hotel.free_on_floor", "hotel", _sample_free_on_floor,
        lambda p: (f"Book a free room on floor {p['floor']} for {p['guest']} "
                   "and tell me the room."),
        lambda p: ([_call("list_free_rooms", floor=p["floor"]),
                    _call("book_room", room=_first_free(p), guest=p["guest"])],
                   f"Room {_first_free(p)}."),
        _free_on_floor_checks),
]}


def _ship_sampler(customers: tuple[str, ...]):
    def sample(rng):
        # the hub is filled in by the task source from its hidden rule (or at random for warm-up tasks)
        return {"initial": {c: "" for c in customers}, "customer": rng.choice(customers),
                "order": rng.randrange(100, 1000)}
    return sample


def _ship_family(family_id: str, domain: str, customers: tuple[str, ...]) -> Family:
    """Ship a customer's order through the hub a hidden per-customer rule assigns."""
    return Family(
        family_id, domain, _ship_sampler(customers),
        lambda p: f"Ship order {p['order']} for {p['customer']}.",
        lambda p: ([_call("ship_order", customer=p["customer"], hub=p["hub"])], f'Shipped via "{p["hub"]}".'),
        lambda p: [(f"{p['customer']}'s order went via {p['hub']}", lambda st, ans: st.get(p["customer"]) == p["hub"]),
                   _unchanged(p["initial"], (p["customer"],))])


OPT_IN_FAMILIES: dict[str, Family] = {f.family_id: f for f in [
    _ship_family("dispatch.ship", "dispatch", CUSTOMERS),
    _ship_family("fleet.ship", "fleet", FLEET_CUSTOMERS),
]}
ALL_FAMILIES = {**FAMILIES, **OPT_IN_FAMILIES}


@dataclasses.dataclass(frozen=True)
class HiddenRule:
    """A family parameter the instruction does not state: ``target = rule[key]`` for a map
    drawn once per task source (seeded), balanced over ``values``."""

    key: str
    keys: tuple[str, ...]
    target: str
    values: tuple[str, ...]

    def draw(self, rng: random.Random) -> dict[str, str]:
        """A balanced map: each value serves len(keys) / len(values) keys (rounded)."""
        vals = [self.values[i % len(self.values)] for i in range(len(self.keys))]
        rng.shuffle(vals)
        return dict(zip(self.keys, vals))


HIDDEN_RULES: dict[str, HiddenRule] = {"dispatch.ship": HiddenRule("customer", CUSTOMERS, "hub", HUBS),
                                        "fleet.ship": HiddenRule("customer", FLEET_CUSTOMERS, "hub", HUBS)}


# Tasks whose correct outcome leaves the state as it was (the condition does not hold) are
# done only when the condition was looked up: family -> params -> (description, calls that
# verify it). A verifying call counts when it ran (a tool error from inside the tool, such
# as "carol has only 40", counts too; a rejected call does not).
VERIFY: dict[str, Callable[[dict[str, Any]], tuple[str, list[tuple[str, dict[str, Any]]]]]] = {
    "bank.withdraw_if_enough": lambda p: (
        f"looked up {p['account']}'s balance",
        [("get_balance", {"account": p["account"]}),
         ("withdraw", {"account": p["account"], "amount": p["amount"]})]),
    "shop.restock_below": lambda p: (
        f"looked up the {p['item']} stock", [("check_stock", {"item": p["item"]})]),
}
