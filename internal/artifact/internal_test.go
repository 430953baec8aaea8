package artifact

import (
	"errors"
	"net/http"
	"testing"
)

type okTransport struct{ calls int }

func (t *okTransport) RoundTrip(*http.Request) (*http.Response, error) {
	t.calls++
	return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody}, nil
}

func TestGuardRefusesPlainHTTP(t *testing.T) {
	for _, tc := range []struct {
		url      string
		insecure bool
		ok       bool
	}{
		{"https://10.0.0.5/v2/", false, true},
		{"http://10.0.0.5:5000/v2/", false, false}, // go-containerregistry falls back to HTTP for private addresses
		{"http://registry.example.com/token", false, false},
		{"http://127.0.0.1:5000/v2/", false, true},
		{"http://[::1]:5000/v2/", false, true},
		{"http://localhost:5000/v2/", false, true},
		{"http://10.0.0.5:5000/v2/", true, true},
	} {
		next := &okTransport{}
		g := &guardTransport{c: &Client{allowHTTP: tc.insecure}, next: next}
		req, _ := http.NewRequest(http.MethodGet, tc.url, nil)
		_, err := g.RoundTrip(req)
		if tc.ok != (err == nil) || tc.ok != (next.calls == 1) {
			t.Errorf("%s (insecure %v): %v", tc.url, tc.insecure, err)
		}
		if err != nil && !errors.Is(err, errPlainHTTP) {
			t.Errorf("%s: %v", tc.url, err)
		}
	}
}

func TestSharedBytes(t *testing.T) {
	base := []extent{{0, 1000, 100}, {100, 5000, 100}, {300, 9000, 50}}
	// A copy of base whose bytes 20..30 and 150..250 were rewritten.
	disk := []extent{{0, 1000, 20}, {20, 7000, 10}, {30, 1030, 70}, {100, 5000, 50}, {150, 8000, 100}, {300, 9000, 50}}
	if got, want := sharedBytes(disk, base), uint64(20+70+50+50); got != want {
		t.Errorf("shared %d, want %d", got, want)
	}
	if got := sharedBytes([]extent{{0, 1, 10}}, base); got != 0 {
		t.Errorf("unrelated: %d", got)
	}
}
