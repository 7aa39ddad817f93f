"""Our studies, one folder each: spec or scripts, README, results."""
