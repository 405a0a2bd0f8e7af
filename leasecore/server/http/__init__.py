"""The embedded server's HTTP side: ``api`` (the REST routes over the store) and ``httpd`` (HTTP/1.1
keep-alive sockets in front of it)."""
