"""jaggc_studies: what is built on the jaggc compiler but is not the compiler: the benchmarks
(``bench``), the fidelity studies (``fidelity``), the three trained bases (``digits``, ``shapes``,
``textures``) with their weights and the demo, the trainers' loss shapes (``trainer_shapes``,
``trainer_check``) and the built-in example losses (``example_losses``).

It reaches the compiler through jaggc's API; nothing in ``jaggc`` imports it (tests/repository/test_layering.py).
Its commands (``jaggc demo``, ``jaggc bench``, ``jaggc trainers``, ...) join the ``jaggc`` command line
through the ``jaggc.commands`` entry point.
"""
