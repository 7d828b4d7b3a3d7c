"""What the ``CommTimer`` logs: pure step accounting (``accounting``), the ranks' straggler exchange (``straggler``),
the run's shared ``Recorder`` (``recording``) and the communication track of its traces (``comm_track``). Definitions:
``docs/comm_timer.md``.
"""
