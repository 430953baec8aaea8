package firecracker

// The initramfs follows package vmboot's contract (the same layout the QEMU runtime
// boots): space-agent as /init, the kernel modules the guest needs in /modules with
// their load order. Package initramfs builds and caches it, in <RootDir>/initramfs; this
// runtime picks its own modules because Firecracker's guests need different ones:
// no virtio console or serial port, but the vsock transport.

// guestModules are the modules a Firecracker guest needs before it can mount its root
// disk and serve the agent: virtio over MMIO (described by Firecracker through ACPI and
// on the kernel command line), the block device, the vsock transport, and ext4.
// Whatever the kernel has built in is skipped; dependencies come from modules.dep.
func guestModules() []string {
	return []string{"virtio_mmio", "virtio_blk", "vmw_vsock_virtio_transport", "ext4"}
}

// initramfsDir is where built initramfs images are cached, under the root dir.
const initramfsDir = "initramfs"

// kernelDir is where a vmlinux extracted from a compressed kernel is kept, under the
// root dir.
const kernelDir = "kernel"
