"""A fleet of network hosts on one machine (Linux network namespaces on a private bridge): ``fleet.netns``."""
