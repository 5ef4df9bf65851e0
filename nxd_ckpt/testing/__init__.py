"""Helpers shipped for users' own tests: ``threadworld.ThreadWorld`` (ranks as threads of one process, a real
TCPStore), ``counting`` (store operations, storage reads and requests counted) and ``fakes`` (a tiny model, its
training steps, bit-exact state comparison). They need nothing beyond nxd_ckpt's own dependencies; the project's
test harness (spawned ranks, crash loops, power loss, S3 server, fake accelerator) is ``harness/``, outside the
package."""
