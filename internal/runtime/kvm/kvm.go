// Package kvm owns the one host check the microVM runtimes share: whether KVM can run
// ordinary guest kernels here.
package kvm

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// Check reports whether hardware KVM can run ordinary guests and names the CPU feature
// found (vmx or svm). The CPU must offer hardware virtualization (in /proc/cpuinfo) and
// /dev/kvm must open read-write. Some hosts expose /dev/kvm for a paravirtual mode only
// (e.g. kvm_pvm, as inside some cloud microVMs), under which ordinary guest kernels
// hang: the CPU flag tells them apart. The error names what is missing.
func Check() (feature string, err error) {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "", fmt.Errorf("read /proc/cpuinfo: %w", err)
	}
	return check(string(data), func() error {
		f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
		if err == nil {
			f.Close()
		}
		return err
	})
}

func check(cpuinfo string, openKVM func() error) (string, error) {
	hw := ""
	for _, line := range strings.Split(cpuinfo, "\n") {
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
	kvmErr := openKVM()
	switch {
	case hw == "" && kvmErr == nil:
		return "", errors.New("no vmx/svm in /proc/cpuinfo: /dev/kvm is paravirtual-only here")
	case hw == "":
		return "", fmt.Errorf("no vmx/svm in /proc/cpuinfo and no usable /dev/kvm (%v)", kvmErr)
	case kvmErr != nil:
		return "", fmt.Errorf("%s present but /dev/kvm unusable: %w", hw, kvmErr)
	}
	return hw, nil
}
