//go:build !amd64

package qemu

// hostTSCkHz is unknown off amd64: the guest calibrates its TSC itself.
func hostTSCkHz() int64 { return 0 }
