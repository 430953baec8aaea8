package gvisor

import (
	"testing"

	"github.com/spacedev/space/internal/runtime"
)

func TestIgnoresCgroups(t *testing.T) {
	for _, tc := range []struct {
		flags []string
		want  bool
	}{
		{nil, false},
		{[]string{"--debug-log=/tmp/x/"}, false},
		{[]string{"--ignore-cgroups"}, true},
		{[]string{"-ignore-cgroups"}, true},
		{[]string{"--ignore-cgroups=true"}, true},
		{[]string{"--ignore-cgroups=false"}, false},
	} {
		r := &Runtime{cfg: Config{ExtraFlags: tc.flags}}
		if got := r.ignoresCgroups(); got != tc.want {
			t.Errorf("%q: ignoresCgroups = %v, want %v", tc.flags, got, tc.want)
		}
	}
}

// The memory watch's threshold lies between the guest's size and the host limit, with
// at least the minimum margin under the limit where there is room for it.
func TestPressureThreshold(t *testing.T) {
	if got := pressureThreshold(runtime.Spec{MemoryMB: 256}) >> 20; got != 368 {
		t.Errorf("256 MiB: threshold %d MiB, want 368 (host limit 416)", got)
	}
	if got := pressureThreshold(runtime.Spec{}); got != 0 {
		t.Errorf("no memory size: threshold %d, want none", got)
	}
	for _, mib := range []int{64, 128, 256, 512, 1024, 4096, 16384} {
		for _, pids := range []int{0, 16, 100, 1000, 10000} {
			spec := runtime.Spec{MemoryMB: mib, PidsLimit: pids}
			limit, th, guest := hostMemoryLimit(spec), pressureThreshold(spec), int64(mib)<<20
			if th <= guest || th >= limit {
				t.Errorf("%d MiB, pids %d: threshold %d MiB outside (%d, %d)", mib, pids, th>>20, guest>>20, limit>>20)
			}
			if limit-th < min(minPressureMargin, (limit-guest)/2) {
				t.Errorf("%d MiB, pids %d: margin %d MiB under the limit %d MiB", mib, pids, (limit-th)>>20, limit>>20)
			}
		}
	}
}

// TestTrimStateDump: a checkpoint's encoding error keeps its first line and the path
// of the object gVisor could not save, not the dumps that follow.
func TestTrimStateDump(t *testing.T) {
	msg := "checkpoint failed: checkpointing container \"x\": encoding error: Cannot save endpoint with bound host socket:\n" +
		"goroutine 868 [running]:\ngvisor.dev/gvisor/pkg/state.safely.func1()\n\tstate.go:309 +0x19e\n" +
		"for object transport.connectionedEndpoint{baseEndpoint:transport.baseEndpoint{}, path:\"/root/app.sock\", ops:{}}:\ngoroutine 868 [running]:\n"
	want := "checkpoint failed: checkpointing container \"x\": encoding error: Cannot save endpoint with bound host socket (path /root/app.sock)"
	if got := trimStateDump(msg); got != want {
		t.Errorf("trimStateDump = %q, want %q", got, want)
	}
	if got := trimStateDump("plain error"); got != "plain error" {
		t.Errorf("trimStateDump of a plain error = %q", got)
	}
}
