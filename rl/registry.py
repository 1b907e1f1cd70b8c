"""Name -> function tables, so a config string picks an advantage estimator, a policy loss or
a loss reduction, and a user registers a new one with a decorator."""
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
  """A table of functions of one kind (the kind names them in errors)."""

  def __init__(self, kind: str):
    self.kind = kind
    self._fns: dict[str, F] = {}

  def register(self, name: str) -> Callable[[F], F]:
    """Decorator: registers `fn` under `name` (an error if the name is taken)."""
    def wrap(fn: F) -> F:
      if name in self._fns:
        raise ValueError(f"{self.kind} {name!r} is already registered")
      self._fns[name] = fn
      return fn
    return wrap

  def get(self, name: str) -> F:
    if name not in self._fns:
      raise ValueError(f"unknown {self.kind} {name!r}; available: {self.names()}")
    return self._fns[name]

  def names(self) -> list[str]:
    return sorted(self._fns)
