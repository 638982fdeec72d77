"""Harmony (models larger than the devices' memory): the engine, its runner and the shared host state.
The schedule itself is ``pipedream.schedules.harmony``; its settings ``pipedream.config.harmony``."""
