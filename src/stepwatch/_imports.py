"""Act when the training script imports a module stepwatch never imports itself (MLflow, the
savers of torch.distributed.checkpoint, safetensors and transformers).

:class:`ImportWatch` is a ``sys.meta_path`` entry that finds nothing of its own: for a watched
name only, it asks the finders after it for the module's spec and wraps that spec's loader's
``exec_module`` (on the loader instance, which serves that one module) so that ``then(name)``
runs as the module finishes running, before the importer binds any of its names. Any other
import costs one set lookup; the watch takes itself off ``sys.meta_path`` once every name has
been seen, or at :meth:`ImportWatch.stop`.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Iterable


class ImportWatch:
    """Calls ``then(name)`` after each of ``names`` is first imported (from any thread, in that
    import; an exception from ``then`` is swallowed, never raised into the import). A module that
    fails to import calls nothing."""

    def __init__(self, names: Iterable[str], then: Callable[[str], None]) -> None:
        self.names = frozenset(names)
        self.then: Callable[[str], None] | None = then
        self._asking: set[str] = set()  # names being looked up by us (import locks are per name)
        self._lock = threading.Lock()

    def start(self) -> "ImportWatch":
        """Watch the names not imported yet (all imported already: nothing to watch)."""
        self.names = frozenset(n for n in self.names if n not in sys.modules)
        if self.names:
            sys.meta_path.insert(0, self)
        return self

    def stop(self) -> None:
        self.then = None
        try:
            sys.meta_path.remove(self)
        except ValueError:  # already taken off (all seen, or by someone else)
            pass

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names or fullname in self._asking or self.then is None:
            return None
        self._asking.add(fullname)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)  # the finders after this one (see _asking)
        except Exception:
            return None  # the import goes on without us, and fails or succeeds as it would have
        finally:
            self._asking.discard(fullname)
        loader = getattr(spec, "loader", None) if spec is not None else None
        run = getattr(loader, "exec_module", None)
        if run is None or isinstance(loader, type):  # a class as loader (builtins) is shared: left alone
            return None
        watch = self

        def exec_module(module: Any) -> None:
            run(module)
            watch._seen(fullname)

        try:
            loader.exec_module = exec_module  # type: ignore[union-attr]
        except Exception:  # a loader that takes no attributes: left as it is
            return None
        return spec

    def _seen(self, fullname: str) -> None:
        with self._lock:
            self.names = self.names - {fullname}
            then = self.then
            if not self.names:
                self.stop()
        if then is not None:
            try:
                then(fullname)
            except Exception:  # never into the script's import
                pass
