package gvisor

import "testing"

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
