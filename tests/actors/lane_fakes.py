"""Stand-ins for lane actors in tests that run one actor alone."""

from __future__ import annotations


class RecordingAdmission:
    """Records the reservations `Lane.end_request` releases."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
