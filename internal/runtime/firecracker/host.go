package firecracker

import "github.com/spacedev/space/internal/runtime/kvm"

// CheckKVM reports whether this host can run Firecracker guests (see kvm.Check); the
// error names what is missing.
func CheckKVM() error {
	_, err := kvm.Check()
	return err
}
