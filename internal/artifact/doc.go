// Package artifact is space's shared artifact store: it pushes template releases and
// sandbox snapshots from a node's btrfs store (internal/storage) to an OCI registry —
// the CNCF distribution registry, Harbor, a cloud registry — and pulls them into
// another node's store when that node needs one. It speaks the OCI distribution
// protocol through go-containerregistry (remote.Pusher and remote.Puller); the artifacts
// are OCI image manifests with space's own artifact, config and layer media types.
//
// # Artifacts
//
//	<prefix>/releases:sha256-<hex>   a release, content-addressed by its tree digest
//	<prefix>/snapshots:<id>          a snapshot, tagged with the id its pusher gives
//
// A release artifact's config (application/vnd.space.release.config.v1+json) holds
// the release metadata (storage.Release), the length of its stream and its send
// identity (below); its layers are the `btrfs send` stream of the release's root
// filesystem. A snapshot artifact's config (…snapshot.config.v1+json) holds the id,
// the release, the disk format, the parent of the disk's increment and the caller's
// metadata; its layers are, in order, the parts "base" (only when the parent travels
// with the snapshot), "disk" (the increment), "checkpoint" (a tar of the checkpoint
// directory) and "agent" (only when the checkpoint needs a host file to restore: the
// agent binary gVisor maps the restored agent's code from; its sha256 and length are in
// the config). Like a base, an agent's blobs are shared by every snapshot that carries
// the same binary: uploaded once (a pusher compresses a binary once and then only checks
// that its blobs are there), and not counted in OwnSize. A pull does not download the
// agent: the snapshot names it (Snapshot.AgentSHA256), and PullAgent downloads and
// checks it for a caller that lacks that binary.
// Manifests carry the push time (org.opencontainers.image.created), the
// release and the snapshot id as annotations, so that List needs no config.
//
// # Streams, chunks and verification
//
// Each stream is cut into chunks of Config.ChunkSize (32 MiB) uncompressed bytes,
// compressed with zstd one by one (application/vnd.space.btrfs-send.v1+zstd,
// …checkpoint.tar.v1+zstd, …agent.v1+zstd), each chunk one blob annotated with its part and
// uncompressed size. Blobs are uploaded first — go-containerregistry skips any blob
// the repository has, so an interrupted push re-sends only the missing chunks (btrfs
// send and the encoder are deterministic: the same subvolume gives the same blobs) —
// and the manifest last: until then no tag names the artifact, and nothing pulls it.
// A pull downloads each blob whole into memory, checks its size and sha256 digest, and
// only then decompresses it, refusing a chunk that decompresses to anything but its
// declared size. Pulls by digest also have the manifest checked; releases have their
// received tree's digest checked against the release digest as well.
//
// Streams are received by `btrfs receive --chroot` behind storage's stream filter,
// which refuses streams that name any subvolume but the expected parent (a crafted
// stream could otherwise clone another sandbox's files). Everything is assembled in the
// store's tmp/ and published with one rename (storage.ArtifactBuild, ReceiveRelease):
// a failed or interrupted pull leaves nothing behind, and running out of disk fails
// with fault.InsufficientStorage (checked up front against the declared sizes, and
// again by the file system while receiving).
//
// # Increments
//
// A snapshot's disk is sent as an increment on a parent that every receiver has or
// can get, so that a snapshot of a sandbox that wrote little is small:
//
//   - A root filesystem (gVisor) is a snapshot of its release: `btrfs send -p release`
//     sends only what the sandbox changed. btrfs receive finds the parent by the UUID
//     the stream names — the release's "send identity", its received UUID if it was
//     itself received, else its own. Every node that pulled the release from the
//     registry has that identity. A node that built the same release itself (same
//     digest, another subvolume) sends its own copy as the snapshot's base part
//     (uploaded once: later snapshots find its blobs); a receiver whose own build is not
//     the parent pulls the registry's copy into its bases.
//   - An ext4 image (VM runtimes) is diffed by btrfs too, not by a block diff of our
//     own: a "disk base" is a read-only subvolume holding a reflink of the release's
//     image; the snapshot is a snapshot of that base whose image file is replaced, in
//     place, by a reflink of the sandbox's disk, so `btrfs send -p base` compares the two
//     images extent by extent and sends only the extents the guest wrote. The base
//     itself is the snapshot's base part: its blobs are uploaded with the first snapshot
//     of the release from that node and found in the registry by every later one; a
//     receiver keeps pulled bases in its store (storage.DiskBases) and downloads only
//     increments after the first. A whole compressed image per snapshot was the
//     alternative (about 100 MB for the base template); release images are not
//     byte-identical across nodes (mkfs stamps UUIDs and times), so a diff against
//     each node's own image could not be applied elsewhere. PushSnapshot picks the base
//     a disk shares the most extents with (FIEMAP), so a sandbox made from a pulled
//     snapshot is sent against the base it came with.
//
// Checkpoints are sent whole (zstd makes their empty pages nearly free; pulls write
// them back sparse).
//
// # Registry access
//
// Credentials are a username and password, or a Docker config.json (its auths entry for
// the registry host or its credential helper), else anonymous. HTTPS is the default;
// plain HTTP is used only with loopback registries, or any with Config.Insecure (a
// transport guard enforces it, since go-containerregistry falls back to HTTP for
// private addresses on its own). Errors carry fault kinds: an unreachable or failing
// registry is fault.Unavailable and names the registry, refused credentials
// fault.Unauthorized, a missing artifact fault.NotFound, a blob that fails
// verification fault.BadGateway.
//
// # Garbage collection
//
// List returns each artifact with its manifest digest and push time; Delete removes a
// manifest by digest, or by tag with the digest it must still name. Blobs stay until
// the registry's own garbage collection. The contract that makes collection safe
// against concurrent use (the caller implements the policy):
//
//  1. References live in the database: whoever pushes records the returned digest
//     (a template version's release digest, a sandbox's snapshot digest) before it
//     relies on the artifact, and pulls by digest where it has one.
//  2. An artifact may be deleted only when no row references it and none has for a
//     grace period (one hour is ample) that is longer than the longest push or pull:
//     a pull that resolved a reference before it was dropped finishes within it.
//  3. An artifact pushed less than the grace period ago is never deleted: its pusher
//     may not have recorded it yet. A release is kept while any snapshot of it is
//     (List gives each snapshot's release).
//  4. A pull that loses the race anyway fails with fault.NotFound and leaves nothing
//     behind; the caller retries with the new reference or reports.
//  5. Node caches (pulled snapshots, disk bases) are the node's own: a pulled snapshot
//     may go once the sandboxes made from it have their copies (O(1) copies that do
//     not depend on it); a disk base only costs an upload again when it is gone.
package artifact
