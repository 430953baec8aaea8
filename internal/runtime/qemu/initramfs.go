package qemu

// The initramfs (space-agent as /init plus guestModules) is built and cached by package
// initramfs, in <RootDir>/initramfs.

// guestModules are the modules the guest needs before it can mount its root disk and
// talk to the host: virtio over MMIO (microvm's transport), the block device, the
// console and serial ports, the entropy device and ext4. Whatever the kernel has built
// in is skipped; dependencies come from modules.dep.
func guestModules() []string {
	return []string{"virtio_mmio", "virtio_blk", "virtio_console", "virtio_rng", "virtio_net", "virtio_balloon", "ext4"}
}

// optionalModule tells the modules a kernel may lack without being unusable here
// (without virtio_net, only sandboxes with a network policy cannot run).
func optionalModule(name string) bool {
	return name == "virtio_rng" || name == "virtio_net" || name == "virtio_balloon"
}

// initramfsDir is where built initramfs images are cached, under the root dir.
const initramfsDir = "initramfs"
