// Command netprobe is a plain HTTP client for network tests run inside sandboxes (e.g.
// under gVisor): for each URL argument it prints "ok <url> <status> <body>" or
// "fail <url> <error>". It resolves names through /etc/resolv.conf (pure Go resolver).
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"
)

func main() {
	c := &http.Client{Timeout: 4 * time.Second}
	for _, u := range os.Args[1:] {
		resp, err := c.Get(u)
		if err != nil {
			fmt.Println("fail", u, err)
			continue
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		fmt.Println("ok", u, resp.StatusCode, strings.TrimSpace(string(b)))
	}
}
