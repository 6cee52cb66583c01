"""Simulation: FLOP counts, the verification scheduler (Algorithm 2), SPS profiles and the serving simulator."""
