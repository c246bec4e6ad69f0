"""Runs a function on a module right after its first import, in processes a test does not
start itself (the workers vLLM spawns, SGLang's scheduler). Used by the test-only CPU patches
(tests/engines/cpu_sitecustomize) and the engines benchmark's timers
(benchmarks/engines_site): a sitecustomize on PYTHONPATH calls install() at start-up, before
any engine code, and imports nothing heavy itself."""

import importlib.abc
import importlib.machinery
import sys


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """Finds the hooked modules with the path finder and runs the hook after the module ran."""

    def __init__(self, hooks, warn):
        self._hooks = hooks
        self._warn = warn

    def find_spec(self, name, path=None, target=None):
        hook = self._hooks.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        original = loader.exec_module
        warn = self._warn

        def exec_module(module):
            original(module)
            try:
                hook(module)
            except Exception as e:
                warn(f"patch of {name} failed: {e!r}")

        loader.exec_module = exec_module
        return spec


def install(hooks: dict, warn) -> None:
    """hooks: module name -> function(module); warn(str) reports a hook that raised."""
    if hooks:
        sys.meta_path.insert(0, _PostImportHooks(dict(hooks), warn))
