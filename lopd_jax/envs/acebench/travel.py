"""ACEBench's airline scenario (``Travel``): users, flights, reservations.

Our implementation of upstream's ``model_inference/multi_turn/scenariosen/travel.py``
(github.com/ACEBench/ACEBench, commit e6db74b): the same data, messages and state changes.
Every public method is an API the agent may call, as upstream (which dispatches any public
method). Kept quirks that change results: ``reserve_flight`` with a wrong password or an
unknown flight fails with a Python error (a missing key / ``None``), new reservations have
no origin / destination, ``cancel_reservation`` refunds to cash but keeps the reservation,
and the clock is fixed at 2024-07-14 06:00 for cancellations.
"""

from __future__ import annotations

import datetime
from typing import Any

_FREE_BAGS = {"regular": {"Economy Class": 1, "Business Class": 2}, "silver": {"Economy Class": 2, "Business Class": 3},
              "gold": {"Economy Class": 3, "Business Class": 3}}
_FLIGHTS = [  # flight_no, origin, destination, depart, arrive, seats, economy, business
    ("CA1234", "Beijing", "Shanghai", "2024-07-15 08:00:00", "2024-07-15 10:30:00", 5, 1200, 3000),
    ("MU5678", "Shanghai", "Beijing", "2024-07-16 09:00:00", "2024-07-16 11:30:00", 3, 1900, 3000),
    ("CZ4321", "Shanghai", "Beijing", "2024-07-16 20:00:00", "2024-07-16 22:00:00", 8, 2500, 4000),
    ("CZ4352", "Shanghai", "Beijing", "2024-07-17 20:00:00", "2024-07-17 22:00:00", 8, 1600, 2500),
    ("MU3561", "Beijing", "Nanjing", "2024-07-18 08:00:00", "2024-07-18 10:00:00", 8, 1500, 4000),
    ("MU1566", "Beijing", "Nanjing", "2024-07-18 20:00:00", "2024-07-18 22:00:00", 8, 1500, 4000),
    ("CZ1765", "Nanjing", "Shenzhen", "2024-07-17 20:30:00", "2024-07-17 22:00:00", 8, 1500, 2500),
    ("CZ1765", "Nanjing", "Shenzhen", "2024-07-18 12:30:00", "2024-07-18 15:00:00", 8, 1500, 2500),
    ("MH1765", "Xiamen", "Chengdu", "2024-07-17 12:30:00", "2024-07-17 15:00:00", 8, 1500, 2500),
    ("MH2616", "Chengdu", "Xiamen", "2024-07-18 18:30:00", "2024-07-18 21:00:00", 8, 1500, 2500),
    ("MH2616", "Chengdu", "Fuzhou", "2024-07-16 18:30:00", "2024-07-16 21:00:00", 8, 1500, 2500)]
_NOW = datetime.datetime(2024, 7, 14, 6, 0, 0)
_FMT = "%Y-%m-%d %H:%M:%S"


class Travel:
    """The airline: three users, eleven flights, four reservations."""

    def __init__(self):
        """The initial users, flights and reservations."""
        self.users = {
            "user1": {"user_name": "Eve", "password": "password123", "cash_balance": 2000.0, "bank_balance": 50000.0,
                      "membership_level": "regular"},
            "user2": {"user_name": "Frank", "password": "password456", "cash_balance": 8000.0, "bank_balance": 8000.0,
                      "membership_level": "silver"},
            "user3": {"user_name": "Grace", "password": "password789", "cash_balance": 1000.0, "bank_balance": 5000.0,
                      "membership_level": "gold"}}
        keys = ("flight_no", "origin", "destination", "depart_time", "arrival_time", "seats_available",
                "economy_price", "business_price")
        self.flights = []
        for row in _FLIGHTS:
            flight = dict(zip(keys, row))
            flight = {**{k: flight[k] for k in keys[:5]}, "status": "available",
                      **{k: flight[k] for k in keys[5:]}}
            self.flights.append(flight)
        self.reservations = [
            {"reservation_id": f"res_{i + 1}", "user_id": u, "flight_no": f, "payment_method": "bank", "cabin": c,
             "baggage": 1, "origin": o, "destination": d}
            for i, (u, f, c, o, d) in enumerate([
                ("user1", "CA1234", "Economy Class", "Beijing", "Shanghai"),
                ("user1", "MU5678", "Business Class", "Shanghai", "Beijing"),
                ("user2", "MH1765", "Business Class", "Xiamen", "Chengdu"),
                ("user2", "MU2616", "Business Class", "Chengdu", "Xiamen")])]

    def _load_scenario(self, scenario: dict) -> None:
        """No scenario options (upstream ignores them)."""

    def _flight(self, flight_no: str, available: bool = False) -> dict | None:
        return next((f for f in self.flights
                     if f["flight_no"] == flight_no and (not available or f["status"] == "available")), None)

    def get_flight_details(self, origin: str = None, destination: str = None) -> list | str:
        """Flights by origin and / or destination."""
        found = [f for f in self.flights if (not origin or f["origin"] == origin)
                 and (not destination or f["destination"] == destination)]
        return [dict(f) for f in found] if found else "There are no direct flights that meet the criteria."

    def get_user_details(self, user_id: str, password: str) -> dict:
        """A user's profile without the password."""
        user = self.users.get(user_id)
        if user and user["password"] == password:
            return {k: v for k, v in user.items() if k != "password"}
        return {"status": "error", "message": "Incorrect username or password."}

    def get_reservation_details(self, reservation_id: str = None, user_id: str = None) -> list | dict:
        """Reservations by id or by user, each with its flight."""
        if reservation_id:
            found = [r for r in self.reservations if r["reservation_id"] == reservation_id]
        elif user_id:
            found = [r for r in self.reservations if r["user_id"] == user_id]
        else:
            return {"status": "error", "message": "Please provide a valid reservation ID or user ID"}
        return [{**r, "flight_info": self._flight(r["flight_no"])} for r in found]

    def authenticate_user(self, user_id: str, password: str) -> dict:
        """The user record, or an error dict."""
        user = self.users.get(user_id)
        if user and user["password"] == password:
            return user
        return {"status": "error", "message": "Incorrect username or password."}

    def get_baggage_allowance(self, membership_level: str, cabin_class: str) -> int:
        """Free checked bags for a membership level and cabin."""
        return _FREE_BAGS.get(membership_level, {}).get(cabin_class, 0)

    def find_transfer_flights(self, origin_city: str, transfer_city: str, destination_city: str) -> list | str:
        """Two-leg connections whose first leg lands before the second departs."""
        first = [f for f in self.flights if f["origin"] == origin_city and f["destination"] == transfer_city
                 and f["status"] == "available"]
        second = [f for f in self.flights if f["origin"] == transfer_city and f["destination"] == destination_city
                  and f["status"] == "available"]
        pairs = [{"first_leg": a, "second_leg": b} for a in first for b in second
                 if datetime.datetime.strptime(a["arrival_time"], _FMT)
                 < datetime.datetime.strptime(b["depart_time"], _FMT)]
        return pairs or "No connecting flights that meet the criteria were found."

    def calculate_baggage_fee(self, membership_level: str, cabin_class: str, baggage_count: int) -> int:
        """50 per bag over the free allowance."""
        return max(baggage_count - _FREE_BAGS[membership_level][cabin_class], 0) * 50

    def update_balance(self, user: dict, payment_method: str, amount: float) -> bool:
        """Add ``amount`` to the cash or bank balance unless it would go negative."""
        key = {"cash": "cash_balance", "bank": "bank_balance"}.get(payment_method)
        if key is not None:
            if user[key] + amount < 0:
                return False
            user[key] += amount
        return True

    def reserve_flight(self, user_id: str, password: str, flight_no: str, cabin: str, payment_method: str,
                       baggage_count: int) -> str:
        """Book a flight, paying fare and baggage fee from cash or bank."""
        user = self.authenticate_user(user_id, password)
        flight = self._flight(flight_no, available=True)
        total = flight["economy_price"] if cabin == "Economy Class" else flight["business_price"]
        total += self.calculate_baggage_fee(user["membership_level"], cabin, baggage_count)
        if payment_method not in ("cash", "bank"):
            return "Invalid payment method"
        key = f"{payment_method}_balance"
        if total > self.users[user_id][key]:
            return (f"Your {payment_method} balance is insufficient. Please consider using another payment "
                    "method.")
        self.users[user_id][key] -= total
        flight["seats_available"] -= 1
        rid = f"res_{len(self.reservations) + 1}"
        self.reservations.append({"reservation_id": rid, "user_id": user_id, "flight_no": flight_no,
                                  "payment_method": payment_method, "cabin": cabin, "baggage": baggage_count})
        return f"Booking successful. Reservation ID: {rid}. Total cost: {total} yuan (including baggage fees)."

    def modify_flight(self, user_id: str, reservation_id: str, new_flight_no: str = None, new_cabin: str = None,
                      add_baggage: int = 0, new_payment_method: str = None) -> str:
        """Change the flight (same route), the cabin (pay or refund the difference) or add bags."""
        res = next((r for r in self.reservations
                    if r["reservation_id"] == reservation_id and r["user_id"] == user_id), None)
        if not res:
            return "Reservation not found or user ID does not match."
        current = self._flight(res["flight_no"])
        if not current:
            return "Flight information not found."
        pay = new_payment_method if new_payment_method else res["payment_method"]
        user = self.users[user_id]
        notes = []
        if new_flight_no and new_flight_no != res["flight_no"]:
            new = self._flight(new_flight_no)
            if not (new and new["origin"] == current["origin"] and new["destination"] == current["destination"]):
                return "Flight change failed: Invalid new flight number or destination does not match."
            res["flight_no"] = new_flight_no
            notes.append("Flight number has been changed.")
        if new_cabin and new_cabin != res.get("cabin"):
            diff = self.calculate_price_difference(current, res["cabin"], new_cabin)
            res["cabin"] = new_cabin
            if diff > 0:
                notes.append(f"Cabin change successful. Price difference paid: {diff}."
                             if self.update_balance(user, pay, -diff)
                             else "Insufficient balance to pay the cabin price difference.")
            elif diff < 0:
                self.update_balance(user, pay, -diff)
                notes.append(f"Cabin change successful. Price difference refunded: {-diff}.")
        if add_baggage > 0:
            total = res.get("baggage", 0) + add_baggage
            cost = max(0, total - self.get_baggage_allowance(user["membership_level"], res["cabin"])) * 50
            if cost > 0:
                notes.append(f"Baggage has been added. Additional fee to be paid: {cost}."
                             if self.update_balance(user, pay, -cost)
                             else "Insufficient balance to pay the additional baggage fees.")
            res["baggage"] = total
        return " ".join(notes or ["Modification completed with no additional fees."])

    def cancel_reservation(self, user_id: str, reservation_id: str, reason: str) -> str:
        """Refund a reservation to cash (the whole fare, or 90% within a day of departure)."""
        user = self.users.get(user_id, None)
        if not user:
            return "Invalid user ID."
        res = next((r for r in self.reservations
                    if r["reservation_id"] == reservation_id and r["user_id"] == user_id), None)
        if not res:
            return "Invalid reservation ID or it does not belong to the user."
        flight = self._flight(res["flight_no"])
        if not flight:
            return "Invalid flight information."
        depart = datetime.datetime.strptime(flight["depart_time"], _FMT)
        if _NOW > depart:
            return "The flight segment has been used and cannot be canceled."
        price = flight["economy_price"] if res["cabin"] == "Economy Class" else flight["business_price"]
        if reason == "The airline has canceled the flight.":
            self.process_refund(user, price)
            return (f"The flight has been canceled. Your reservation will be canceled free of charge, and {price} "
                    "yuan has been refunded.")
        if depart - _NOW > datetime.timedelta(days=1):
            self.process_refund(user, price)
            return f"More than 24 hours before departure. Free cancellation successful, {price} yuan has been refunded."
        fee = price * 0.1
        self.process_refund(user, price - fee)
        return (f"Less than 24 hours before departure. A cancellation fee of {fee} yuan has been deducted, and "
                f"{price - fee} yuan has been refunded.")

    def process_refund(self, user: dict, amount: float) -> None:
        """Add ``amount`` to the user's cash balance."""
        user["cash_balance"] += amount

    def calculate_price_difference(self, flight: dict, old_cabin: str, new_cabin: str) -> Any:
        """New cabin price minus old (an unknown cabin counts 0)."""
        prices = {"Economy Class": flight["economy_price"], "Business Class": flight["business_price"]}
        return prices.get(new_cabin, 0) - prices.get(old_cabin, 0)
