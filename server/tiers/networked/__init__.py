"""What any networked lower tier needs, once (none of it knows the store's client library):

* presence.py: `Presence`, the tier's memory of what the store holds (block key -> chunk, or missing), with
  expiries, bounded, with PrefixIndex's shadowed-holder fallback for shared block-prefix aliases;
* prober.py: `Prober`, the background thread that asks the store about chunks a lookup did not know (the
  lookup answers "pending" meanwhile) and runs other off-path jobs;
* breaker.py: `Breakers`, one circuit breaker per node, whose failure classifier the tier injects.
"""
