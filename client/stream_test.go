package client

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestSSEParsing checks events, ids, comments, multi-line data and data lines longer
// than the reader's buffer.
func TestSSEParsing(t *testing.T) {
	long := strings.Repeat("A", 200000)
	body := ": keepalive\n\nevent: start\ndata: {\"pid\":1}\n\nid: 5\nevent: stdout\ndata: {\"data\":\"" + long + "\"}\n\n" +
		"data: a\ndata: b\n\n"
	st := &Stream{resp: &http.Response{Body: io.NopCloser(strings.NewReader(body))}, br: newReader(strings.NewReader(body))}
	var got []Event
	for {
		ev, err := st.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ev)
	}
	if len(got) != 3 || got[0].Name != "start" || got[1].ID != "5" || len(got[1].Data) != len(long)+11 ||
		got[2].Name != "message" || string(got[2].Data) != "a\nb" {
		t.Fatalf("events: %d %+v", len(got), got)
	}
}
