package kvm

import (
	"errors"
	"os"
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	opens := func() error { return nil }
	missing := func() error { return os.ErrNotExist }
	for _, c := range []struct {
		cpuinfo string
		open    func() error
		want    string // feature, or a part of the error
	}{
		{"processor : 0\nflags : fpu vmx sse\n", opens, "vmx"},
		{"flags\t\t: fpu svm\n", opens, "svm"},
		{"flags : fpu sse\n", opens, "paravirtual-only"},
		{"flags : fpu sse\n", missing, "no usable /dev/kvm"},
		{"flags : vmx\n", missing, "vmx present but /dev/kvm unusable"},
	} {
		got, err := check(c.cpuinfo, c.open)
		if err != nil {
			got = err.Error()
		}
		if !strings.Contains(got, c.want) {
			t.Errorf("check(%q) = %q, want %q", c.cpuinfo, got, c.want)
		}
		if c.want == "vmx" || c.want == "svm" {
			if err != nil || got != c.want {
				t.Errorf("check(%q) = %q, %v", c.cpuinfo, got, err)
			}
		}
	}
	if _, err := check("flags : vmx\n", missing); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the /dev/kvm error is not wrapped: %v", err)
	}
}
