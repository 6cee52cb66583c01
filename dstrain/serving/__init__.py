"""Serving: the verification scheduler (Algorithm 2), SPS profiles and the closed-loop serving simulator."""
