"""Would a rebuild help?  The one place that answers it: from a binary alone (the audit's
verdict) and from the binary and the pinned source's guards (the main job's decide step)."""
