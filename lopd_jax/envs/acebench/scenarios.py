"""ACEBench's agent scenarios: the phone platform (device, messages, reminders, food
delivery) and the airline, as state objects whose public methods are the agent's APIs.

Our implementation of upstream's scenario classes (github.com/ACEBench/ACEBench, commit
e6db74b): the same initial data, return values, messages and state changes, because the agent
categories are graded on the end state (:data:`SAVED_ATTRS`) and the exact call texts. Upstream's
quirks are kept where they change a result: ``ReminderApi`` and ``FoodPlatform`` skip the base
initialiser, ``cancel_reservation`` refunds but keeps the reservation, and a wrong password in
``reserve_flight`` fails on a missing key. :func:`build_instances` loads a scenario as upstream
does; :func:`execute` runs parsed calls and formats the results as upstream's execution role.
Details: ``docs/evaluation.md``.
"""

from __future__ import annotations

import copy
import datetime
import inspect
import json
from typing import Any

from lopd_jax.envs.acebench.travel import Travel

# The attributes of each class that the end-state check compares (upstream's SAVED_CLASS).
SAVED_ATTRS = {"BaseApi": ("wifi", "logged_in"), "MessageApi": ("inbox",), "ReminderApi": ("reminder_list",),
               "FoodPlatform": ("users", "logged_in_users", "orders"), "Travel": ("users", "reservations")}

_PEOPLE = ("Eve", "Frank", "Grace", "Helen", "Isaac", "Jack")
_JOBS = ("Software Engineer", "Data Scientist", "Product Manager", "UX Designer", "DevOps Engineer",
         "Marketing Specialist")
_PHONES = ("123-456-7890", "234-567-8901", "345-678-9012", "456-789-0123", "567-890-1234", "678-901-2345")
_PASSWORDS = ("password123", "password456", "password789", "password321", "password654", "password654")


def _status(ok: bool, message: str, **extra: Any) -> dict[str, Any]:
    return {"status": ok, "message": message, **extra}


class BaseApi:
    """The device: Wi-Fi and login state."""

    def __init__(self):
        """Wi-Fi off, logged in."""
        self.wifi = False
        self.logged_in = True

    def _load_scenario(self, scenario: dict) -> None:
        self.wifi = scenario.get("wifi", False)
        self.logged_in = scenario.get("logged_in", True)

    def turn_on_wifi(self) -> dict:
        """Turn Wi-Fi on."""
        self.wifi = True
        return _status(True, "Wi-Fi has been turned on")

    def login_device(self) -> dict:
        """Log in to the device."""
        self.logged_in = True
        return _status(True, "Device has been logged in")


class MessageApi(BaseApi):
    """Text messages between six users; the inbox holds at most six messages."""

    def __init__(self):
        """Six users and six messages (ids 1-6)."""
        super().__init__()
        self.max_capacity = 6
        self.user_list = {name: {"user_id": f"USR{100 + i}", "phone_number": _PHONES[i], "occupation": _JOBS[i]}
                          for i, name in enumerate(_PEOPLE)}
        texts = [
            ("USR100", "USR101", "Hey Frank, don't forget about our meeting on 2024-06-11 at 4 PM in Conference Room 1.",
             "2024-06-09"),
            ("USR101", "USR102", "Can you help me order a \"Margherita Pizza\" delivery? The merchant is Domino's.",
             "2024-03-09"),
            ("USR102", "USR103", "Please check the milk tea delivery options available from Heytea and purchase a "
             "cheaper milk tea for me. After making the purchase, remember to reply to me with \"Already bought.\"",
             "2023-12-05"),
            ("USR103", "USR102", "No problem Helen, I can assist you.", "2024-09-09"),
            ("USR104", "USR105", "Isaac, are you available for a call?", "2024-06-06"),
            ("USR105", "USR104", "Yes Jack, let's do it in 30 minutes.", "2024-01-15")]
        self.inbox = {i + 1: {"sender_id": s, "receiver_id": r, "message": m, "time": t}
                      for i, (s, r, m, t) in enumerate(texts)}
        self.message_id_counter = 6

    def send_message(self, sender_name: str, receiver_name: str, message: str) -> dict:
        """Send a message (needs login, Wi-Fi and a free inbox slot)."""
        if not self.logged_in:
            return _status(False, "Device not logged in, unable to send message")
        if not self.wifi:
            return _status(False, "Wi-Fi is turned off, cannot send messages at this time")
        if len(self.inbox) >= self.max_capacity:
            return _status(False, "Inbox capacity is full. You need to ask the user which message to delete.")
        if sender_name not in self.user_list or receiver_name not in self.user_list:
            return _status(False, "Sender or receiver does not exist")
        self.message_id_counter += 1
        self.inbox[self.message_id_counter] = {"sender_id": self.user_list[sender_name]["user_id"],
                                               "receiver_id": self.user_list[receiver_name]["user_id"],
                                               "message": message}
        return _status(True, f"Message successfully sent to {receiver_name}.")

    def delete_message(self, message_id: int) -> dict:
        """Delete a message by id."""
        if not self.logged_in:
            return _status(False, "Device not logged in, unable to delete message")
        if message_id not in self.inbox:
            return _status(False, "Message ID does not exist")
        del self.inbox[message_id]
        return _status(True, f"Message ID {message_id} has been successfully deleted.")

    def view_messages_between_users(self, sender_name: str, receiver_name: str) -> dict:
        """The messages sent from one user to another."""
        if not self.logged_in:
            return _status(False, "Device not logged in, unable to view message information")
        if sender_name not in self.user_list:
            return _status(False, "Sender does not exist")
        if receiver_name not in self.user_list:
            return _status(False, "Receiver does not exist")
        s, r = self.user_list[sender_name]["user_id"], self.user_list[receiver_name]["user_id"]
        found = [{"id": i, "sender": sender_name, "receiver": receiver_name, "message": m["message"]}
                 for i, m in self.inbox.items() if m["sender_id"] == s and m["receiver_id"] == r]
        if not found:
            return _status(False, "No related message records found")
        return {"status": True, "messages": found}

    def search_messages(self, user_name: str, keyword: str) -> dict:
        """A user's sent and received messages containing ``keyword`` (case-insensitive)."""
        if user_name not in self.user_list:
            return _status(False, "User does not exist")
        uid = self.user_list[user_name]["user_id"]
        found = [{"id": i, "sender_id": m["sender_id"], "receiver_id": m["receiver_id"], "message": m["message"]}
                 for i, m in self.inbox.items()
                 if uid in (m["sender_id"], m["receiver_id"]) and keyword.lower() in m["message"].lower()]
        if not found:
            return _status(False, "No messages found containing the keyword")
        return {"status": True, "messages": found}

    def get_all_message_times_with_ids(self) -> dict:
        """Message id -> time."""
        if not self.logged_in:
            return _status(False, "Device not logged in, unable to retrieve all message times and their "
                                  "corresponding message IDs.")
        return {i: m["time"] for i, m in self.inbox.items()}

    def _extreme_message_id(self, which: str, latest: bool) -> dict:
        if not self.logged_in:
            return _status(False, f"Device not logged in, unable to retrieve the {which} sent message ID.")
        if not self.inbox:
            return _status(False, "No message records found")
        best_id, best = None, None
        for i, m in self.inbox.items():  # a sent message has no time: KeyError, as upstream
            t = datetime.datetime.strptime(m["time"], "%Y-%m-%d")
            if best is None or (t > best if latest else t < best):
                best_id, best = i, t
        return _status(True, f"The {which} message ID is {best_id}", message_id=best_id)

    def get_latest_message_id(self) -> dict:
        """The id of the newest message (by its date)."""
        return self._extreme_message_id("latest", True)

    def get_earliest_message_id(self) -> dict:
        """The id of the oldest message (by its date)."""
        return self._extreme_message_id("earliest", False)


class ReminderApi(BaseApi):
    """Reminders (at most six)."""

    def __init__(self):  # upstream does not call BaseApi.__init__: no wifi / logged_in yet
        """Three reminders (ids 1-3)."""
        self.max_capacity = 6
        self.reminder_list = {
            1: {"reminder_id": 1001, "title": "Doctor's Appointment", "description": "Visit Dr. Smith for a checkup.",
                "time": "2024-07-15 09:30", "notified": False},
            2: {"reminder_id": 1002, "title": "Team Meeting", "description": "Monthly project review with the team.",
                "time": "2024-07-17 11:00", "notified": False},
            3: {"reminder_id": 1003, "title": "To-do list",
                "description": "First, help Frank place a food delivery order at \"Hema Fresh,\" ordering two "
                               "\"Fresh Gift Packs.\" Then, send a message to Frank saying, \"The price of the "
                               "purchased goods is () yuan.\" Replace the parentheses with the actual amount, "
                               "keeping one decimal place.",
                "time": "2024-07-16 11:00", "notified": False}}
        self.reminder_id_counter = 3

    def view_reminder_by_title(self, title: str) -> dict:
        """The reminder with this exact title."""
        if not self.logged_in:
            return _status(False, "The device is not logged in, so you cannot view notifications")
        for reminder in self.reminder_list.values():
            if reminder["title"] == title:
                return {"status": True, "reminder": reminder}
        return _status(False, f"No reminder found with the title '{title}'.")

    def add_reminder(self, title: str, description: str, time: str) -> dict:
        """Add a reminder (needs login and a free slot)."""
        if not self.logged_in:
            return _status(False, "Device not logged in. Unable to add a new reminder.")
        if len(self.reminder_list) >= self.max_capacity:
            return _status(False, "Reminder capacity is full. Unable to add a new reminder.")
        self.reminder_id_counter += 1
        rid = self.reminder_id_counter
        self.reminder_list[rid] = {"reminder_id": rid, "title": title, "description": description, "time": time,
                                   "notified": False}
        return _status(True, f"Reminder '{title}' was successfully added.")

    def delete_reminder(self, reminder_id: int) -> dict:
        """Delete a reminder by id."""
        if not self.logged_in:
            return _status(False, "Device not logged in. Unable to delete the specified reminder.")
        if reminder_id not in self.reminder_list:
            return _status(False, "Reminder ID does not exist.")
        del self.reminder_list[reminder_id]
        return _status(True, f"Reminder ID {reminder_id} was successfully deleted.")

    def view_all_reminders(self) -> dict:
        """Every reminder (title, description, time, notified)."""
        if not self.reminder_list:
            return _status(False, "No reminders found.")
        keys = ("title", "description", "time", "notified")
        return {"status": True, "reminders": [{k: r[k] for k in keys} for r in self.reminder_list.values()]}


class FoodPlatform(BaseApi):
    """Food delivery: six users with balances, six merchants with two products each."""

    def __init__(self):  # upstream does not call BaseApi.__init__
        """Balances, menus, no one logged in, no orders."""
        balances = (500.0, 300.0, 150.0, 800.0, 400.0, 120.0)
        self.users = {name: {"user_id": f"U{100 + i}", "password": _PASSWORDS[i], "balance": balances[i]}
                      for i, name in enumerate(_PEOPLE)}
        menus = [("Domino's", "Pizza", "Margherita Pizza", 68.0, "Super Supreme Pizza", 88.0),
                 ("Rice Village Bibimbap", "Bibimbap", "Stone Pot Bibimbap", 35.0, "Korean Beef Bibimbap", 45.0),
                 ("Haidilao", "Hotpot", "Beef Rolls", 68.0, "Seafood Platter", 88.0),
                 ("Heytea", "Milk Tea", "Cheese Milk Tea", 25.0, "Four Seasons Spring Milk Tea", 22.0),
                 ("Hema Fresh", "Fresh Grocery", "Organic Vegetable Pack", 15.0, "Fresh Gift Pack", 99.0),
                 ("Jiutian BBQ", "BBQ", "Korean Grilled Beef", 128.0, "Grilled Pork Belly", 78.0)]
        self.merchant_list = {
            m: {"merchant_id": f"M{100 + i}", "service_type": kind,
                "menu": [{"product": p1, "price": c1}, {"product": p2, "price": c2}]}
            for i, (m, kind, p1, c1, p2, c2) in enumerate(menus)}
        self.logged_in_users: list[str] = []
        self.orders: list[dict] = []

    def _load_scenario(self, scenario: dict) -> None:
        super()._load_scenario(scenario)
        self.logged_in_users = scenario.get("logged_in_users", [])

    def login_food_platform(self, username: str, password: str) -> dict:
        """Log a user in (needs Wi-Fi)."""
        if not self.wifi:
            return _status(False, "Wi-Fi is not enabled, unable to login")
        if username not in self.users:
            return _status(False, "User does not exist")
        if self.users[username]["password"] != password:
            return _status(False, "Incorrect password")
        if username in self.logged_in_users:
            return _status(False, f"{username} is already logged in")
        self.logged_in_users.append(username)
        return _status(True, f"User {username} has successfully logged in!")

    def view_logged_in_users(self) -> dict:
        """The users logged in to the platform."""
        if not self.logged_in_users:
            return _status(False, "No users are currently logged in to the food platform")
        return {"status": True, "logged_in_users": self.logged_in_users}

    def check_balance(self, user_name: str) -> float:
        """A user's balance (0.0 for an unknown user)."""
        return self.users[user_name]["balance"] if user_name in self.users else 0.0

    def add_food_delivery_order(self, username: str, merchant_name: str, items: list) -> dict:
        """Order ``items`` (``[{"product", "quantity"}]``) from a merchant, paid from the balance."""
        if username not in self.logged_in_users:
            return _status(False, f"User {username} is not logged in to the food platform")
        if merchant_name not in self.merchant_list:
            return _status(False, "Merchant does not exist")
        total, lines = 0.0, []
        for item in items:
            product, quantity = item.get("product"), item.get("quantity", 1)
            if not isinstance(quantity, int) or quantity <= 0:
                return _status(False, f"Invalid quantity {quantity} for product {product}")
            entry = next((p for p in self.merchant_list[merchant_name]["menu"] if p["product"] == product), None)
            if entry is None:
                return _status(False, f"Product {product} does not exist in {merchant_name}'s menu")
            total += entry["price"] * quantity
            lines.append({"product": product, "quantity": quantity, "price_per_unit": entry["price"]})
        if total > self.users[username]["balance"]:
            return _status(False, "Insufficient balance to place the order")
        self.users[username]["balance"] -= total
        self.orders.append({"user_name": username, "merchant_name": merchant_name, "items": lines,
                            "total_price": total})
        return _status(True, f"Food delivery order successfully placed with {merchant_name}. "
                             f"Total amount: {total} yuan")

    def get_products(self, merchant_name: str) -> list | dict:
        """A merchant's menu."""
        merchant = self.merchant_list.get(merchant_name)
        return merchant["menu"] if merchant else _status(False, f"Merchant '{merchant_name}' does not exist")

    def view_orders(self, user_name: str) -> dict:
        """A user's orders."""
        mine = [o for o in self.orders if o["user_name"] == user_name]
        return {"status": True, "orders": mine} if mine else _status(False, "User has no order records")

    def search_orders(self, keyword: str) -> dict:
        """Orders whose merchant or a product contains ``keyword``."""
        k = keyword.lower()
        found = [o for o in self.orders if k in o["merchant_name"].lower()
                 or any(k in i["product"].lower() for i in o.get("items", []))]
        return {"status": True, "orders": found} if found else _status(False, "No matching orders found")


def build_instances(involved: list[str], initial_config: dict) -> dict[str, Any]:
    """One fresh object per involved class, each loaded with its own part of
    ``initial_config`` and then with the ``BaseApi`` part (upstream's order)."""
    classes = {"BaseApi": BaseApi, "MessageApi": MessageApi, "ReminderApi": ReminderApi,
               "FoodPlatform": FoodPlatform, "Travel": Travel}
    out = {}
    for name in involved:
        if name not in classes:
            raise ValueError(f"unknown ACEBench scenario class {name!r}; known: {sorted(classes)}")
        obj = classes[name]()
        obj._load_scenario(copy.deepcopy(initial_config.get(name, {})))
        obj._load_scenario(copy.deepcopy(initial_config.get("BaseApi", {})))
        out[name] = obj
    return out


def _methods(instances: dict[str, Any]) -> dict[str, list]:
    table: dict[str, list] = {}
    for obj in instances.values():
        for name, fn in inspect.getmembers(obj, predicate=inspect.ismethod):
            if not name.startswith("_"):
                table.setdefault(name, []).append(fn)
    return table


def _format(value: Any) -> Any:
    """Upstream's execution role: dicts go through JSON (int keys become strings), other
    non-strings through ``str``; then every item is read back as JSON when it parses."""
    if isinstance(value, dict):
        try:
            value = json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
    elif not isinstance(value, str):
        value = str(value)
    try:
        return json.loads(value)
    except ValueError:
        return value


def execute(instances: dict[str, Any], calls: list[dict[str, dict]], stop_on_error: bool) -> tuple[list, bool]:
    """Run ``[{name: {param: value}}]`` against ``instances``; returns the formatted results
    and whether any call failed. A failing call's result is ``"Error during execution: ..."``;
    ``stop_on_error`` (the multi-turn role) stops at the first failure."""
    table, results, failed = _methods(instances), [], False
    for call in calls:
        (name, kwargs), = call.items()
        try:
            if name not in table:
                raise AttributeError(f"no API named {name!r}")
            for fn in table[name]:
                value = fn(**kwargs)
            results.append(_format(value))
        except Exception as e:  # the agent's call failing inside the scenario is an observation
            failed = True
            results.append(f"Error during execution: {e}")
            if stop_on_error:
                break
    return results, failed


def end_state(instances: dict[str, Any]) -> list[dict[str, dict]]:
    """``[{class: {saved attribute: value}}]`` in involved order, through JSON as upstream's
    result file (int keys become strings)."""
    state = [{name: {k: v for k, v in vars(obj).items() if k in SAVED_ATTRS[name]}}
             for name, obj in instances.items()]
    return json.loads(json.dumps(state, default=str))
