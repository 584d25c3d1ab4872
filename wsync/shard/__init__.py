"""Sharded trainers into sharded engines: layouts as data, a routing plan, point-to-point sync, one commit.

See layout.py for the data, route.py for the plan, sync.py for the transfer and the commit across engine ranks.
"""
