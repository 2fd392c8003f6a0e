"""What every layer shares and that depends on nothing else of the package: the loopback guard,
latency statistics, time formatting, the JSON alias, argument helpers and the loader of the
simulator's compiled build (`native`)."""
