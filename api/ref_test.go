package api

import (
	"strings"
	"testing"
)

func TestParseTemplateRef(t *testing.T) {
	d := "sha256:" + strings.Repeat("a", 64)
	for _, tc := range []struct {
		in, want string
		bad      bool
	}{
		{"base", "base:latest", false},
		{"base:v1", "base:v1", false},
		{"my-tmpl.2:2024_01", "my-tmpl.2:2024_01", false},
		{"base@" + d, "base@" + d, false},
		{"", "", true},
		{"Base", "", true},
		{"../etc", "", true},
		{"base:", "", true},
		{"base@sha256:abc", "", true},
		{"a/b", "", true},
		{"base:" + strings.Repeat("x", 200), "", true},
	} {
		r, err := ParseTemplateRef(tc.in)
		if (err != nil) != tc.bad {
			t.Errorf("%q: err %v, want bad=%v", tc.in, err, tc.bad)
			continue
		}
		if err == nil && r.String() != tc.want {
			t.Errorf("%q → %q, want %q", tc.in, r.String(), tc.want)
		}
	}
}
