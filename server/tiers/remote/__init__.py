"""The remote tier: chunks in a Redis >= 7 / Valkey >= 8 store (standalone or Cluster) that every node sharing
`--remote-prefix` reads and writes, through valkey-glide's sync client (zero-copy SET from a memoryview, GET
into the caller's buffer). Facts behind the choices: /work/shared/reference/remote-tier.md.

Layout (`<ns>`, `<key>`: hex of the namespace fingerprint and the chunk key):

    <prefix>:<ns>:{<key>}:h           generation (8 random bytes per put) + record.py's header (fields, XXH3-128
                                      checksum of the fields and the payload)
    <prefix>:<ns>:{<key>}:<gen>:<i>   payload part i (1 MiB; the last one shorter) of that generation
    <prefix>:<ns>:{<alias>}:a         holders of a block-prefix alias, so that a lookup ending inside a chunk
                                      finds it as FsTier's index does locally: records of chunk key + leading
                                      block count (u32), one after another, the newest last (APPENDed)

The hash tag is the chunk key: a chunk's header and parts live in one Cluster slot, and a prompt's chunks
spread over every master.

Tenants (tenancy.py): a namespace of a named tenant (its cache salt, tenants.py's `tenant_of`, among the
quota tables' names and --remote-tenants) has its keys under `<prefix>:t:<tenant>:` instead of `<prefix>:`,
the rest as above, so that an ACL user limited to `~<prefix>:t:<tenant>:*` reaches that tenant's keys only;
the default tenant's keys keep the layout from before tenants. The tier sees fingerprints: the base of each
comes from its namespace's salt on this node (a namespace not registered here cannot be named: a miss, a
skipped write).

Writes (`put`, write-behind threads): skipped when the header exists (another node wrote it: `existing`);
else the parts (one non-atomic batch), then the header with SET NX, then the chunk is added as a holder to
each alias key (`_add_holder`), all with the TTL (parts a little longer, so a header never outlives its parts
by expiry). Every chunk holding a prefix is kept, as PrefixIndex's shadowed holders locally: two prompts that
share a document and differ after it both hold its leading blocks, and when one holder expires or goes, a
probe finds the others (a string, not a Redis set: the probe's one MGET still reads it; compacted to the
newest ALIAS_HOLDERS by the writer that grows it past ALIAS_COMPACT_BYTES). A put that loses the NX race
deletes its own parts: a reader only ever sees one generation's parts, whose checksum is in its header, so
two writers of different bytes never mix. A node that answers OOM (full, its policy evicts nothing) gets no
writes for FULL_PAUSE_S[0], doubled per refused retry (skipped writes counted); reads go on.
Reads (`get`, promotion threads): the parts in MGETs of up to
GROUP_PARTS (8 MiB) straight into the L1 pages (a part that crosses a page run goes through a staging
buffer), the header in the first MGET when a probe saw the chunk's generation (one round trip for a chunk
of up to 8 MiB that a lookup found; the parts are only used if the header read with them is that
generation's), else the header's GET first; sizes and checksum verified before True; a missing part or
header (`missing`) or a bad one (`corrupt`: a wrong size or checksum, never an error reply, which is a
counted miss) is a miss and the header is deleted (only if it is still the one read; GET and UNLINK, the
documented ACL's commands), never served; that generation is ignored for BAD_TTL_S, so it is counted once
even when its delete failed (counted, logged). glide copies an MGET's values into the buffers inside the
call, so the pages are not written after it returns (the caller owns them until then).
A chunk read gets its TTL back (PEXPIRE, throttled per chunk: `_touch`).

Lookups (`find_prefix`, the serving loop) never wait: they answer from a presence cache (block key ->
(record, leading blocks) or missing, with an expiry, bounded), and for a chunk it does not know they start
one probe on the probe thread (an MGET of the header and alias keys; on a Cluster glide asks every master
at once) and answer None
("pending"); the next lookup finds the answers. Known misses end the run.

Failures: no retries on the data path; glide's request timeout is `--remote-timeout-ms` or 4x a part's time
at the measured bandwidth, whichever is longer (a batch's: 4x its bytes' time; a thread's client is made
anew when that moved RESIZE_FACTOR away; a connection's setup: at least `--remote-connect-timeout-ms`).
One circuit breaker per node address (purgatory's state machine; its bookkeeping under a lock of ours, never
the call: calls run in parallel): while one is open, that node's reads are misses, its writes dropped and
its lookups misses, all counted, and the maintenance thread PINGs it after `--remote-breaker-reset-s`; an
answer closes it. The breakers of nodes that leave the Cluster's slot map go with it (health follows the
current masters).

Access (options.RemoteAccess): TLS with a private CA and a client certificate; a password file read every
PASSWORD_CHECK_S, whose new password open clients take for their next authentication (one that never
connected is replaced); reads from replicas, where a chunk a replica shows missing or damaged is read again
from the primary before anything is deleted or counted (a replica may lag).

Accounting (the tier contract's properties, cheap and non-blocking): `used_bytes` and `capacity_bytes` are
the store's INFO used_memory and maxmemory summed over its masters (every node's data, not only this one's;
refreshed every few seconds off the loop; capacity 0 = no limit), `entries` the chunks the presence cache
knows to be there, `written`/`written_bytes` what this node wrote. The store owns capacity (maxmemory with
a volatile-* or allkeys-* policy): nothing here evicts; a store that cannot evict is warned of at start.

Modules (one job each): layout.py (key names, part sizing, the alias record, the slot), tenancy.py (a
namespace's key base), options.py (the tier's options: URL, access, tenants), nodes.py (slot map, clients, calls under breakers), writes.py, reads.py,
lookups.py (presence cache, probes, remove), maintenance.py (TTL refresh, breaker PINGs, INFO, password
reload), metrics.py (kvtier_remote_*), tier.py (`RemoteTier`, `make_tier`). What any networked tier needs
(presence cache, prober, breakers) is in ../networked/. Importing this package imports nothing of glide;
tier.py and the data-path modules do (the registry imports them only when a remote tier is configured).
"""
