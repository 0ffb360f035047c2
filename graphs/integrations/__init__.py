"""neatpack.graphs.integrations: a neatpack loader inside the training frameworks people use.

One small module per framework, each importing its framework only when used (an extra per
framework in ``pyproject.toml``). ``transformers.Trainer`` itself is served by
``neatpack.graphs.hf_trainer``.
"""
