package qemu

import (
	"fmt"

	"github.com/spacedev/space/internal/runtime/kvm"
)

// Accelerators.
const (
	AccelAuto = "auto"
	AccelKVM  = "kvm"
	AccelTCG  = "tcg"
)

// DetectAccel picks the accelerator for mode and says why: what New would use, found
// without building a runtime. KVM needs both /dev/kvm and hardware virtualization (vmx
// or svm in /proc/cpuinfo): some hosts expose /dev/kvm for a paravirtual mode only
// (e.g. kvm_pvm), under which ordinary guest kernels hang.
func DetectAccel(mode string) (accel, reason string, err error) {
	hw, kvmErr := kvm.Check()
	switch mode {
	case AccelTCG:
		return AccelTCG, "configured", nil
	case AccelKVM:
		if kvmErr != nil {
			return "", "", fmt.Errorf("accel kvm: %w", kvmErr)
		}
		return AccelKVM, "configured", nil
	case AccelAuto, "":
		if kvmErr == nil {
			return AccelKVM, hw + " and /dev/kvm available", nil
		}
		return AccelTCG, kvmErr.Error(), nil
	default:
		return "", "", fmt.Errorf("unknown accel %q (want auto, kvm or tcg)", mode)
	}
}
