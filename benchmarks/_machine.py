"""The ``env`` object every benchmark prints: the machine and library versions its figures
came from, so two runs can be compared only where they match.

    from _machine import machine       # benchmarks/ is the script's own folder on sys.path
    print(json.dumps({..., "env": machine(threads=1)}))

The versions of numpy, torch and transformers appear when the script imported them; ``extra``
adds what only that script knows (its thread setting, a speed yardstick).
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def machine(**extra: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for name in ("numpy", "torch", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            env[name] = getattr(module, "__version__", None)
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch_threads"] = torch.get_num_threads()
    env.update(extra)
    return env
