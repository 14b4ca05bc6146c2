"""Stage 0, what every other stage builds on: ``config`` (``MoEConfig``, presets, ``from_hf_config``), ``errors``
(coded errors and the ``explain`` catalogue), ``envs`` (every environment variable, read only here), ``weights``
(``MoEWeights``, one layer's dense weights), ``activations`` and ``router`` (the torch reference routing)."""
