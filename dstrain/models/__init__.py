"""Drafter building blocks: packed block attention (more land with the Drafters issue)."""
