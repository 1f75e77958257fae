"""The cases, one module per family; importing this package registers every case (harness @case).

Modules run in RUN_ORDER, then any other module here in name order, so a new file needs no entry
elsewhere to run. Within a module, cases run in the order they are defined."""

import importlib
import pkgutil

RUN_ORDER = ("attention", "efficiency", "blocked_kernel", "seq_series", "generation", "cpp")

for _name in RUN_ORDER + tuple(sorted({m.name for m in pkgutil.iter_modules(__path__)} - set(RUN_ORDER))):
    importlib.import_module(f"{__name__}.{_name}")
