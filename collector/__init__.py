"""The steptrace collector, installed as ``steptrace.collector``: joins each step's spans across ranks."""
