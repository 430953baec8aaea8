package artifact

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"testing"

	"github.com/spacedev/space/internal/fault"
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

// TestCopyAgentChecks: a pulled agent binary that is not the one its snapshot's
// config names (other bytes, or more or fewer of them) is refused.
func TestCopyAgentChecks(t *testing.T) {
	bin := []byte("#!agent binary")
	sum := sha256.Sum256(bin)
	want := agentRecord{SHA256: hex.EncodeToString(sum[:]), Bytes: int64(len(bin))}
	for name, data := range map[string][]byte{
		"other":  []byte("#!agent binarz"),
		"longer": append(bytes.Clone(bin), 'x'),
		"short":  bin[:5],
	} {
		var got bytes.Buffer
		if err := copyAgent(&got, bytes.NewReader(data), want); !fault.Is(err, fault.BadGateway) {
			t.Errorf("%s: %v, want a bad gateway", name, err)
		}
	}
	var got bytes.Buffer
	if err := copyAgent(&got, bytes.NewReader(bin), want); err != nil || !bytes.Equal(got.Bytes(), bin) {
		t.Errorf("copied %q (%v)", got.Bytes(), err)
	}
}
