"""perfloop tune: the loop closed on an unchanged script (tuner.py says how)."""
