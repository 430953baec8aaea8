package qemu

import (
	"fmt"
	"os"
	"strings"
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
	hw, kvmErr := kvmUsable()
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

// kvmUsable reports whether KVM can run ordinary guests, naming the CPU feature found.
func kvmUsable() (string, error) {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "", fmt.Errorf("read /proc/cpuinfo: %w", err)
	}
	hw := ""
	for _, line := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(k) != "flags" {
			continue
		}
		for _, f := range strings.Fields(v) {
			if f == "vmx" || f == "svm" {
				hw = f
			}
		}
		break
	}
	f, kvmErr := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if kvmErr == nil {
		f.Close()
	}
	switch {
	case hw == "" && kvmErr == nil:
		return "", fmt.Errorf("no vmx/svm in /proc/cpuinfo: /dev/kvm is paravirtual-only")
	case hw == "":
		return "", fmt.Errorf("no vmx/svm in /proc/cpuinfo and no usable /dev/kvm")
	case kvmErr != nil:
		return "", fmt.Errorf("%s present but /dev/kvm unusable: %w", hw, kvmErr)
	}
	return hw, nil
}
