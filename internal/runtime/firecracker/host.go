package firecracker

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// CheckKVM reports whether this host can run Firecracker guests: the CPU must offer
// hardware virtualization (vmx or svm in /proc/cpuinfo) and /dev/kvm must open
// read-write. Some hosts expose /dev/kvm for a paravirtual mode only (e.g. kvm_pvm, as
// inside some cloud microVMs), under which ordinary guest kernels hang: the CPU flag
// tells them apart. The error names what is missing.
func CheckKVM() error {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return fmt.Errorf("read /proc/cpuinfo: %w", err)
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
		return errors.New("no vmx/svm in /proc/cpuinfo: /dev/kvm is paravirtual-only here")
	case hw == "":
		return fmt.Errorf("no vmx/svm in /proc/cpuinfo and no usable /dev/kvm (%v)", kvmErr)
	case kvmErr != nil:
		return fmt.Errorf("%s present but /dev/kvm unusable: %w", hw, kvmErr)
	}
	return nil
}
