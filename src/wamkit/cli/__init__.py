"""Command line: `wamkit eval | serve | train | export | data | bench | report | demo`."""
