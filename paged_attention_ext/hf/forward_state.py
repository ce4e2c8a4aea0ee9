"""Whether a PagedCache's stored history is whole: the layers of each forward, in order.

A forward stores K/V layer by layer; an exception between two layers leaves its tokens
partly stored. :class:`ForwardState` counts the layers stored in the current forward and the
forwards completed, and after a failure holds why the cache cannot continue: the first
forward's failure is undone by a reset (nothing else was stored), a later one makes every
further update raise until ``reset()``.
"""

from typing import Optional


class ForwardState:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.layers_stored = num_layers  # no forward in flight
        self.forwards_done = 0  # forwards whose every layer stored its K/V
        self.broken: Optional[str] = None  # why the cache must be reset before more use

    @property
    def interrupted(self) -> bool:
        """A forward began and not every layer stored its K/V."""
        return self.layers_stored != self.num_layers

    def begin(self) -> None:
        self.layers_stored = 0

    def layer_stored(self) -> None:
        self.layers_stored += 1
        if self.layers_stored == self.num_layers:
            self.forwards_done += 1

    @staticmethod
    def cannot(action: str, reason: str) -> RuntimeError:
        return RuntimeError(f"PagedCache cannot {action}: {reason}. Call reset() (or use a new "
                            "PagedCache) and start the generation again.")

    def check_usable(self, action: str = "continue") -> None:
        if self.broken is not None:
            raise self.cannot(action, self.broken)

    def interruption(self) -> str:
        return (f"the previous forward stopped after {self.layers_stored} of {self.num_layers} "
                "layers stored their K/V (an exception interrupted it), so its tokens are only "
                "partly stored")

    def fail(self, reason: str) -> bool:
        """Record a failure; True when nothing was complete yet (reset the cache instead)."""
        if self.forwards_done == 0:
            return True
        self.broken = reason
        return False
