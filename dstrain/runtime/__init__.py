"""The distributed runtime: world layout and process groups, the target->drafter channel, the watchdog, the target rank's loop."""
